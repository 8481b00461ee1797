"""bench/gpu_summary.py on real GPU results and on copies with one part broken. The fixture folder
(tests/bench/fixtures/gpu_results_h200) holds what two leases of an H200 on 2026-11-26 left: attention_kernels.log
from the first; pytest -m gpu over tests/engine/models/test_cuda_graphs.py and test_engine_cuda.py,
engine_throughput.log and compiled_step.log from the second (docs/BENCHMARKS.md, "The GPU path on an H200")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.gpu_summary import summarize

RESULTS = Path(__file__).parent / "fixtures" / "gpu_results_h200"


@pytest.fixture
def results(tmp_path) -> Path:
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    return copy


def test_the_h200_run_passes_with_its_numbers(results):
    lines, numbers, ok = summarize(results)
    assert ok and lines[0] == "== make test-gpu: PASSED =="
    assert numbers["pytest"] | {"exit": 0} == {"passed": 8, "failed": 0, "errors": 0, "skipped": 1, "exit": 0}
    graphs = numbers["compiled_step"]
    assert graphs["decode_step"].startswith("CUDA graphs (1, 2, 4, 8")
    assert graphs["speedup_vs_eager"] == {"1": 2.318, "8": 2.148, "64": 2.044}
    assert graphs["greedy_tokens_equal"] and graphs["fallback_steps"] == 0
    assert numbers["engine_throughput"]["max_concurrency"] == 64
    assert "batch 1: 2.32x (206 tok/s)" in lines[-1]


def test_graphs_whose_tokens_differ_from_eager_fail_the_run(results):
    log = results / "compiled_step.log"
    *head, last = log.read_text().strip().splitlines()
    found = json.loads(last)
    found["batches"]["8"]["greedy_tokens_equal"] = False
    log.write_text("\n".join([*head, json.dumps(found)]) + "\n")
    lines, numbers, ok = summarize(results)
    assert not ok and lines[0] == "== make test-gpu: FAILED =="
    assert numbers["compiled_step"]["problem"] == "the CUDA graphs' greedy tokens differ from eager's"


def test_a_benchmark_that_left_no_result_fails_the_run(results):
    (results / "compiled_step.log").write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    (results / "compiled_step.rc").write_text("1\n")
    lines, numbers, ok = summarize(results)
    assert not ok
    assert "decode step CUDA graphs: FAILED: no JSON result line in compiled_step.log (exit status 1)" in lines
