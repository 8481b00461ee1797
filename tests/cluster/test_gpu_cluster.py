"""deploy/manifests/gpu-1.yaml on a real GPU: a local Ray offering this machine's one GPU, the prefill and the
decode replica each holding half of it, the embedded model in bfloat16 on CUDA, KV moved between the two over
UCX. The official `openai` client gets an answer; every replica reports that it computes on CUDA in bfloat16 and
the GPU Ray gave it; the prompt was prefilled on the prefill replica and its KV arrived (no fallback). Then the
cluster stops.

Only on a machine with CUDA (`make test-gpu`); skipped elsewhere."""

from __future__ import annotations

import os

import openai
import pytest
import ray
import torch

from tandem.cluster.manifest_checks import validate_file
from tests.cluster.ray_cluster import MANIFESTS, chat, check_integrity, running, wait_idle
from tests.ports import free_port

MODEL = "SmolLM2-135M-Instruct"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    """gpu-1.yaml copied with its two listen ports moved to free ones, validated as `tandem validate` does
    (ports included), and started on a local Ray of one GPU; stopped (Ray too) after the module."""
    text = (MANIFESTS / "gpu-1.yaml").read_text()
    for key, port in (("grpc", "50051"), ("http", "8000")):  # the listen lines (comments may name the ports too)
        assert text.count(f"{key}: 127.0.0.1:{port}") == 1
        text = text.replace(f"{key}: 127.0.0.1:{port}", f"{key}: 127.0.0.1:{free_port()}")
    path = tmp_path_factory.mktemp("gpu-1") / "gpu-1.yaml"
    path.write_text(text)
    manifest = validate_file(path)
    ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=1, namespace=manifest.ray.namespace,
             include_dashboard=False, log_to_driver=False)
    try:
        with running(manifest) as cluster:
            yield cluster
            wait_idle(cluster)
            check_integrity(cluster)
    finally:
        ray.shutdown()


def test_a_chat_completion_on_one_shared_gpu(gpu_cluster):
    client = openai.OpenAI(base_url=f"http://{gpu_cluster.http_endpoint}/v1", api_key="unused-without-auth",
                           max_retries=0, timeout=180)
    reply = client.chat.completions.create(model=MODEL, messages=chat("What is the capital of France?"),
                                           max_tokens=32, temperature=0)
    answer = reply.choices[0].message.content
    assert answer and answer.strip(), reply
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0

    status = gpu_cluster.status()
    router = status["router"]
    assert router["prefill_decisions"].get("prefill_pool/prefill_pool", 0) >= 1, router  # disaggregated
    assert router["transfer_fallbacks"] == 0, router  # the KV went GPU -> GPU over UCX and arrived

    replicas = {r["pool"]: r for r in status["replicas"]}
    assert set(replicas) == {"prefill", "decode"}
    gpus = set()
    for pool, replica in replicas.items():
        assert replica["state"] == "ready", replica
        assert replica["device"] == "cuda bfloat16", replica
        [rank] = replica["rank_placements"]  # tp=1: one rank, the replica actor itself
        assert rank["device"].startswith("cuda"), replica
        assert rank["visible_gpus"], replica  # Ray's assignment, exported as CUDA_VISIBLE_DEVICES
        gpus.add(rank["visible_gpus"])
    assert len(gpus) == 1, f"both replicas should share the one GPU: {gpus}"
    assert replicas["prefill"]["num_steps"] > 0  # the prompt was computed there
