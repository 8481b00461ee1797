"""The model benchmarks (bench/decode_roofline.py, bench/engine_throughput.py) run every mode they offer and take
another model (--model / --like, bench/model_choice.py): each is run here for a few tokens on a narrow dummy-weight
shape, decode_roofline's packed-int4 mode on the embedded model (slow), and bench/speculative.py's proposers, batch
cases and replay on the embedded model, so a broken mode fails a test (one did, with `load_model() got an
unexpected keyword argument 'packed'`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.loader.published_models import MADE_BY, PUBLISHED
from tests.engine.loader.test_dummy_weights import _narrow, _write

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, env_compile: str | None = None) -> dict:
    """The script's JSON report; env_compile: TANDEM_COMPILE for its run (None: as the suite's)."""
    env = os.environ | ({"TANDEM_COMPILE": env_compile} if env_compile is not None else {})
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def narrow_llama(tmp_path_factory, embedded_shape) -> Path:
    """A Llama-3.2-1B-shaped folder, 2 layers and narrow, marked as written by make-model (dummy weights)."""
    config = _narrow(PUBLISHED["meta-llama/Llama-3.2-1B-Instruct"]) | {"num_hidden_layers": 2}
    folder = _write(tmp_path_factory.mktemp("models") / "narrow", config, embedded_shape.tokenizer)
    (folder / MADE_BY).write_text("{}")
    return folder


def test_decode_roofline_measures_a_dummy_shape_against_transformers_of_the_same_config(narrow_llama):
    report = run_bench("decode_roofline.py", "--model", str(narrow_llama), "--modes", "float32,bfloat16",
                       "--tokens", "3", "--rounds", "1", "--profile")
    assert report["model"] == f"{narrow_llama} (dummy weights)"
    for mode in ("float32", "bfloat16"):
        run = report["runs"][mode]
        assert "error" not in run, run
        assert run["tandem_tokens_per_s"] > 0 and run["transformers_tokens_per_s"] > 0
        assert 0 < run["tandem_roofline_fraction"] and run["tandem_weight_bytes_per_token"] > 0
        assert run["profile"], (mode, run)


def test_engine_throughput_measures_a_dummy_shape_against_transformers_of_the_same_config(narrow_llama):
    report = run_bench("engine_throughput.py", "--model", str(narrow_llama), "--concurrency", "1,4", "--tokens", "3",
                       "--rounds", "1", "--hf-requests", "1", "--ttft-rounds", "0")
    assert "error" not in report, report.get("error")
    assert report["model"] == f"{narrow_llama} (dummy weights)"
    assert set(report["engine_tokens_per_s"]) == {"1", "4"} and report["transformers_static_tokens_per_s"] > 0
    assert "prefix_cache" not in report


def test_engine_throughput_runs_in_bfloat16_with_its_prompt_length_and_prefix_cache_modes(narrow_llama):
    report = run_bench("engine_throughput.py", "--model", str(narrow_llama), "--concurrency", "2", "--tokens", "3",
                       "--rounds", "1", "--hf-requests", "1", "--ttft-rounds", "1", "--dtype", "bfloat16",
                       "--prompt-tokens", "32")
    assert "error" not in report, report.get("error")
    assert report["dtype"] == "bfloat16" and report["engine_tokens_per_s"]["2"] > 0 and report["prefix_cache"]


@pytest.mark.slow  # 70 s on 2 cores: transformers in bfloat16 on a CPU without bfloat16 instructions
def test_decode_roofline_runs_its_packed_int4_mode_with_its_profile():
    report = run_bench("decode_roofline.py", "--modes", "packed-int4", "--tokens", "2", "--rounds", "1", "--profile")
    run = report["runs"]["packed-int4"]
    assert "error" not in run, run
    assert run["tandem_tokens_per_s"] > 0 and report["model"] == "embedded SmolLM2-135M-Instruct"
    assert run["profile"]


@pytest.mark.slow  # the embedded model's GGUF packed, and its bfloat16 transformers peer
def test_engine_throughput_runs_the_packed_laptop_path():
    report = run_bench("engine_throughput.py", "--weights", "packed", "--concurrency", "1", "--tokens", "2",
                       "--rounds", "1", "--hf-requests", "1", "--ttft-rounds", "0")
    assert "error" not in report, report.get("error")
    assert report["weights"] == "packed" and report["engine_tokens_per_s"]["1"] > 0


def test_speculative_runs_every_proposer_and_the_replay_on_both_batches():
    """bench/speculative.py at its smallest: one round of 4 tokens, every proposer, both batch cases (the batch-16
    case queues more requests than run at once) and the offline replay, eager (no compile) to stay short. The bench
    itself exits when a proposer changed a float32 output."""
    report = run_bench("speculative.py", "--rounds", "1", "--tokens", "4", "--requests", "18",
                       "--workloads", "multi_turn", "--proposers", "ngram,suffix,draft", "--replay", env_compile="off")
    for batch in ("batch_1", "batch_16"):
        row = report["engine"]["multi_turn"][batch]
        assert row["off"]["tokens_per_s"] > 0
        for name in ("ngram", "suffix", "draft"):
            assert row[name]["same_outputs"] == 1.0 and row[name]["tokens_per_s"] > 0, (batch, name, row[name])
            assert len(row[name]["rounds"]) == 1 and sum(map(sum, row[name]["timed_steps"].values())) > 0
    assert report["requests"] == 18
    assert set(report["offline_replay"]["multi_turn"]) == {"ngram", "suffix"}
