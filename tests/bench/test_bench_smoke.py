"""Every mode of every bench/ script run at its smallest size, so that a refactor cannot break a benchmark unnoticed
(issue 51 item 6): each must exit 0 and print one JSON object on its last line holding the numbers its section of
docs/BENCHMARKS.md quotes. The numbers themselves say nothing at these sizes and are not checked. The scripts (and
modes) that run in one process are here; those that start a cluster, compile a step or run every quantization mode
are in the slow set (`make test-all`); decode_roofline, engine_throughput, speculative, tenant_scheduling,
disagg_scale, soak and gpu_summary have tests of their own. Not run anywhere: --device cuda (a GPU), --llama-cpp
and structured_output's xgrammar peer (packages `make bench-peers` installs), and --like (a model of billions of
parameters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# script (":mode" names a second run of it), its smallest arguments, keys its JSON must have
IN_PROCESS = {
    "attention_kernels": (["--small", "--rounds", "1"], ["decode", "prefill", "targets_met"]),
    "compiled_step": (["--batches", "1", "--steps", "2", "--rounds", "1"], ["batches", "compile_s"]),
    "linear_kernels": (["--rows", "1", "--dtypes", "float32,bfloat16"], ["runs"]),
    "load_time": (["--repeats", "1"], ["speedup_vs_transformers"]),
    "loadgen_pacing": (["--rates", "20", "--seconds", "0.5"], ["rates"]),
    "routing": (["--prefill", "1", "--groups", "2", "--system-tokens", "64", "--user-tokens", "8", "--requests",
                 "8", "--clients", "2", "--max-tokens", "2", "--no-calibrate", "--prefill-us", "10", "--replicas",
                 "10", "--indexed-blocks", "100"], ["cache_aware", "round_robin", "decision"]),
    "routing:calibrated": (["--prefill", "1", "--groups", "2", "--system-tokens", "64", "--user-tokens", "8",
                            "--requests", "8", "--clients", "2", "--max-tokens", "2", "--replicas", "10",
                            "--indexed-blocks", "100", "--decisions", "10"], ["cache_aware", "round_robin"]),
    "structured_output": (["--batch", "2", "--steps", "2", "--rounds", "1"], ["vocab", "engine"]),
    "kv_transfer": (["--requests", "1", "--tokens", "16", "--prefill-tokens", "0", "--rounds", "1"],
                    ["paths", "batched"]),
    "kv_transfer:pipelined,scattered": (["--requests", "1", "--tokens", "16", "--prefill-tokens", "32", "--rounds",
                                         "1", "--scattered"], ["paths", "batched"]),
    "kv_tiers:engine": (["--engine", "--history", "64", "--new", "16", "--repeats", "1"], ["results", "ratios"]),
    "gc_pauses": (["--extra-millions", "0.1", "--streams", "2"], ["router", "replica", "pause_ratio"]),
    "lora": (["--requests", "2", "--adapters", "1", "--rank", "2", "--tokens", "2", "--rounds", "1", "--compile",
              "off"], ["tokens_per_s", "lora_over_base_time"]),
    "autoscale": (["--quiet-s", "2", "--burst-s", "4", "--after-s", "2", "--start-delay", "0.5", "--max", "2",
                   "--prompt-tokens", "64", "--output-tokens", "4", "--out", "{tmp}"], ["results", "targets"]),
    "autoscale:real-time": (["--real-time", "--peers", "", "--quiet-s", "1", "--burst-s", "2", "--after-s", "1",
                             "--start-delay", "0.5", "--max", "2", "--prompt-tokens", "64", "--output-tokens", "4",
                             "--out", "{tmp}"], ["results", "targets"]),
}
CLUSTERS = {
    "cluster_serving": (["--requests", "1", "--tokens", "2"], ["disaggregated", "colocated", "in_process",
                                                               "serving_path_ms_per_token"]),
    "parallel_scaling": (["--concurrency", "1", "--tokens", "2", "--rounds", "1", "--kv-blocks", "16"], ["layouts"]),
    "kv_tiers": (["--sessions", "1", "--turns", "1", "--input", "fixed:32", "--output", "fixed:2"],
                 ["results", "ratios"]),
    "tenant_cluster": (["--duration", "5", "--out", "{tmp}"], ["fcfs"]),
    "plan_check": (["--cells", "short-0.3", "--duration", "4", "--quiet"], ["cells", "within_25", "choice_best"]),
    "disagg_report": (["--rates", "0.5", "--duration", "5", "--scale", "8", "--scale-duration", "2", "--out",
                       "{tmp}"], ["rates"]),
    "cluster_serving:parallel,streams,traced": (["--requests", "1", "--tokens", "2", "--profile-tokens", "4",
                                                 "--modes", "parallel,colocated_ray_streams,disaggregated_traced"],
                                                ["parallel", "colocated_ray_streams", "disaggregated_traced"]),
    "kv_tiers:pulls,shared-prefix": (["--workload", "shared-prefix", "--sessions", "2", "--prefix-groups", "1",
                                      "--prefix-len", "32", "--input", "fixed:16", "--output", "fixed:2", "--modes",
                                      "pulls-off,pulls-on"], ["results", "ratios"]),
    "tenant_cluster:sjf": (["--compare", "sjf", "--duration", "5", "--out", "{tmp}"], []),
}
# Model benchmarks' heavier modes: compiled steps, bfloat16 on CPUs without bfloat16 instructions, every
# quantization mode's perplexity pass (TANDEM_COMPILE for the run, None: the suite's, off)
HEAVY = {
    "compiled_step:bfloat16": (["--batches", "1", "--steps", "2", "--rounds", "1", "--dtype", "bfloat16"],
                               ["batches", "compile_s"], None),
    "lora:compiled": (["--requests", "2", "--adapters", "1", "--rank", "2", "--tokens", "2", "--rounds", "1",
                       "--compile", "auto"], ["tokens_per_s", "lora_over_base_time"], "on"),
    "quantization": (["--tokens", "2", "--streams", "2", "--rounds", "1", "--transfer-tokens", "16",
                      "--transfer-requests", "1"], [], None),
    "quantization:compiled": (["--modes", "int8 weights", "--tokens", "2", "--streams", "2", "--rounds", "1",
                               "--transfer-tokens", "16", "--transfer-requests", "1", "--compile"], [], "on"),
}


def run_bench(script: str, args: list[str], tmp_path: Path, compile: str | None = None) -> dict:
    """Runs bench/<script>.py (a "name:mode" key: bench/name.py) with args ({tmp}: tmp_path) and TANDEM_COMPILE set
    to `compile` (None: as the suite's); its last JSON line."""
    env = os.environ | ({"TANDEM_COMPILE": compile} if compile is not None else {})
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script.split(':')[0]}.py"),
                           *(a.replace("{tmp}", str(tmp_path)) for a in args)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
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
    if script == "disagg_report":  # and the plots and summary again from the report it wrote, measuring nothing
        check(run_bench(script, ["--from-json", "{tmp}/report.json", "--out", "{tmp}/again"], tmp_path), ["rates"])


@pytest.mark.slow  # a minute or more each on 2 cores
@pytest.mark.parametrize("script", list(HEAVY))
def test_each_heavy_model_benchmark_mode_runs_at_its_smallest_size(script, tmp_path):
    args, keys, compile = HEAVY[script]
    check(run_bench(script, args, tmp_path, compile), keys)


def test_every_benchmark_script_is_run_by_a_test():
    """A new bench/ script needs a smoke test here or a test of its own (then named in `own`)."""
    own = {"decode_roofline", "engine_throughput", "tenant_scheduling", "quantization", "disagg_scale", "soak",
           "speculative", "gpu_summary"}
    helpers = {"machine", "model_choice", "otlp_collector", "disagg_markdown", "manifests", "__init__"}
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    smoked = {key.split(":")[0] for key in {**IN_PROCESS, **CLUSTERS, **HEAVY}}
    assert scripts - own - helpers - smoked == set()


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
