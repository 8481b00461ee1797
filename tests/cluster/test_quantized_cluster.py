"""deploy/manifests/local-quantized.yaml running: int8 weights and int8 KV pages on both pools. Greedy replies
equal one process with the same weights and KV dtype (the pages and their scales cross the transfer as they
are), the status names each replica's KV dtype and weights, and the KV budget holds blocks by their bytes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import ray
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv.kv_cache import KVCacheSpec
from tandem.engine.loader import load_model
from tandem.engine.sampling_params import SamplingParams
from tandem.router.client import TandemClient
from tests.cluster.ray_cluster import QUESTIONS, chat, check_integrity, manifest_for_test, running, simulated_cluster
from tests.engine.engine_helpers import run_all

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster() as _, running(manifest_for_test("local-quantized.yaml")) as tandem:
        yield tandem


def test_greedy_replies_over_int8_weights_and_pages_equal_one_process(cluster):
    """The reference is one engine with the replicas' settings, asked the same questions in the same order: the
    prefill replica's prefix cache serves the chat template's shared system prompt from the second question on,
    and in bfloat16 a cached prefix (its remaining tokens attend under a mask) can round a logit one step apart
    from a whole-prompt prefill; so the reference caches prefixes too."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    threads = torch.get_num_threads()
    # One thread, as each replica's single rank runs (resources.cpus: 1.0), from the load on: the decode attention
    # kernel is chosen by timing on this CPU at that thread count (engine/hardware/kernel_tuning.py).
    torch.set_num_threads(1)
    try:
        loaded = load_model(progress=False, dtype=torch.bfloat16, weight_format="int8")
        engine = LLMEngine(loaded, EngineConfig(kv_cache_dtype="int8", max_model_len=2048, compile=False))
        expected = []
        for i, question in enumerate(QUESTIONS[:3]):
            engine.add_request(str(i), loaded.tokenizer.encode_chat(chat(question)), params)
            expected.append(run_all(engine)[(str(i), 0)].token_ids)
        engine.shutdown()
    finally:
        torch.set_num_threads(threads)
    with TandemClient(cluster.endpoint, timeout_s=120) as client:
        for question, want in zip(QUESTIONS[:3], expected):  # one at a time, as the reference ran them
            got = client.generate(chat=chat(question), max_tokens=MAX_TOKENS, temperature=0)
            assert got.token_ids[0] == want, question
            assert got.prefill_route == "prefill_pool"
    check_integrity(cluster)


def test_status_names_the_kv_dtype_and_weights_and_the_budget_counts_their_bytes(cluster):
    status = cluster.status()
    config = load_model(weights=False, progress=False).config
    per_block = KVCacheSpec(config.num_layers, 1, 16, config.num_kv_heads, config.head_dim, torch.int8).bytes_per_block
    for replica in status["replicas"]:
        assert (replica["kv_dtype"], replica["weights"]) == ("int8", "int8")
        assert replica["device"] == "cpu bfloat16"
        assert replica["kv_blocks_total"] == (256 << 20) // per_block  # kv_cache_bytes: 256MiB


def test_tandem_status_prints_each_replicas_kv_dtype_and_weights(cluster):
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "status", "--address", address],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip().startswith(("prefill-0", "decode-0"))]
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert "(cpu bfloat16, int8 weights)" in line and re.search(r"KV \d+/\d+ blocks \(\d+%, int8\)", line), line
