"""Every bench/ script that runs in one process (or starts its own few) run at its smallest size, so that a
refactor cannot break a benchmark unnoticed (issue 51 item 6): each must exit 0 and print one JSON object on its
last line holding the numbers its section of docs/BENCHMARKS.md quotes. The numbers themselves say nothing at
these sizes and are not checked; the scripts that start a cluster are in the slow set (`make test-all`), and
decode_roofline, engine_throughput, tenant_scheduling, quantization and disagg_scale have tests of their own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# script, its smallest arguments, keys its JSON must have
IN_PROCESS = {
    "attention_kernels": (["--small", "--rounds", "1"], ["decode", "prefill", "targets_met"]),
    "compiled_step": (["--batches", "1", "--steps", "2", "--rounds", "1"], ["batches", "compile_s"]),
    "linear_kernels": (["--rows", "1", "--dtypes", "float32"], ["runs"]),
    "load_time": (["--repeats", "1"], ["speedup_vs_transformers"]),
    "loadgen_pacing": (["--rates", "20", "--seconds", "0.5"], ["rates"]),
    "routing": (["--prefill", "1", "--groups", "2", "--system-tokens", "64", "--user-tokens", "8", "--requests",
                 "8", "--clients", "2", "--max-tokens", "2", "--no-calibrate", "--prefill-us", "10", "--replicas",
                 "10", "--indexed-blocks", "100"], ["cache_aware", "round_robin", "decision"]),
    "structured_output": (["--batch", "2", "--steps", "2", "--rounds", "1"], ["vocab", "engine"]),
    "kv_transfer": (["--requests", "1", "--tokens", "16", "--prefill-tokens", "0", "--rounds", "1"],
                    ["paths", "batched"]),
    "lora": (["--requests", "2", "--adapters", "1", "--rank", "2", "--tokens", "2", "--rounds", "1", "--compile",
              "off"], ["tokens_per_s", "lora_over_base_time"]),
    "autoscale": (["--quiet-s", "2", "--burst-s", "4", "--after-s", "2", "--start-delay", "0.5", "--max", "2",
                   "--prompt-tokens", "64", "--output-tokens", "4", "--out", "{tmp}"], ["results", "targets"]),
}
CLUSTERS = {
    "cluster_serving": (["--requests", "1", "--tokens", "2"], ["disaggregated", "colocated", "in_process",
                                                               "serving_path_ms_per_token"]),
    "parallel_scaling": (["--concurrency", "1", "--tokens", "2", "--rounds", "1", "--kv-blocks", "16"], ["layouts"]),
    "kv_tiers": (["--sessions", "1", "--turns", "1", "--input", "fixed:32", "--output", "fixed:2"],
                 ["results", "ratios"]),
    "tenant_cluster": (["--duration", "5", "--out", "{tmp}"], ["fcfs"]),
    "disagg_report": (["--rates", "0.5", "--duration", "5", "--scale", "8", "--scale-duration", "2", "--out",
                       "{tmp}"], ["rates"]),
}


def run_bench(script: str, args: list[str], tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"),
                           *(a.replace("{tmp}", str(tmp_path)) for a in args)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(report: dict, keys: list[str]) -> None:
    assert isinstance(report, dict) and "error" not in report, report
    missing = [k for k in keys if k not in report]
    assert not missing, f"no {missing} in {sorted(report)}"


@pytest.mark.parametrize("script", list(IN_PROCESS))
def test_each_benchmark_runs_at_its_smallest_size(script, tmp_path):
    args, keys = IN_PROCESS[script]
    check(run_bench(script, args, tmp_path), keys)


@pytest.mark.slow  # each starts a local Ray cluster of the embedded model: minutes together on 2 cores
@pytest.mark.parametrize("script", list(CLUSTERS))
def test_each_cluster_benchmark_runs_at_its_smallest_size(script, tmp_path):
    args, keys = CLUSTERS[script]
    check(run_bench(script, args, tmp_path), keys)


def test_every_benchmark_script_is_run_by_a_test():
    """A new bench/ script needs a smoke test here or a test of its own (then named in `own`)."""
    own = {"decode_roofline", "engine_throughput", "tenant_scheduling", "quantization", "disagg_scale", "soak",
           "speculative", "gc_pauses", "gpu_summary"}
    helpers = {"machine", "model_choice", "otlp_collector", "disagg_markdown", "manifests", "__init__"}
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert scripts - own - helpers - set(IN_PROCESS) - set(CLUSTERS) == set()


def test_the_cluster_benchmarks_time_replicas_compiled_before_serving():
    """make run's manifests compile their decode pools in the background; the benchmarks run them compiling first
    (the engine's default), so that no timed request is served beside the compiler. Nothing else changes."""
    from tandem.bench.manifests import MANIFESTS, manifest_to_measure
    from tandem.cluster.manifest_yaml import load_manifest

    for name in ("local.yaml", "local-colocated.yaml"):
        shipped, measured = load_manifest(MANIFESTS / name), manifest_to_measure(name)
        assert shipped.pools.decode.engine.compile == "background" and measured.pools.decode.engine.compile is None
        unchanged = measured.pools.decode.model_copy(update={"engine": shipped.pools.decode.engine})
        assert unchanged == shipped.pools.decode and measured.router == shipped.router
    assert manifest_to_measure("bench-colocated.yaml") == load_manifest(MANIFESTS / "bench-colocated.yaml")
