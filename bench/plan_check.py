"""`tandem plan` against reality: for each cell (a `tandem plan` workload at a rate), the planner's choice and the best
deployment of the other mode are each written as a manifest, started as a real local cluster and loaded with the
very requests the planner simulated (`tandem bench`'s open loop over gRPC, its warm-up first); the planner's
predicted TTFT p90, ITL p99 and goodput are set beside the measured ones.

Cells are `tandem plan` flag lists (the profiles and the budget are this script's flags). The default four: the
long-prompt mix of issue 52 at 0.12 and 0.2 req/s, and short prompts (lognormal around 96 tokens, 48 out) at 0.3
and 0.6 req/s (rates chosen on a 2-core AVX2 CPU from the planner's own predictions: where both modes meet the SLO
and where they part), on the two 2-core bench profiles of this CPU kind (deploy/profiles/cpu-2core-avx512-bench-*.json where
the CPU has AVX-512, else cpu-2core-avx2-bench-*.json).

    .venv/bin/python bench/plan_check.py [--cells long-0.12,long-0.2,short-0.3,short-0.6] [--duration S] [--out FILE]
                                         [--quiet]

A local Ray head is started and stopped for each deployment; none may be running. About 3 minutes a deployment
(model load and compilation, 60-120 s of load). Reported per cell and deployment: predicted and measured figures
and their ratios (predicted / measured), whether each is within 25%, and whether the choice had the highest
measured goodput. The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LONG = ["--workload", "long-mix", "--duration", "120", "--input", "lognormal:96,0.4", "--long-share", "0.15",
        "--long-input", "uniform:1024,1536", "--output", "fixed:48", "--slo", "ttft=20s,itl_p99=500ms"]
SHORT = ["--workload", "synthetic", "--duration", "60", "--input", "lognormal:96,0.4", "--output", "fixed:48",
         "--slo", "ttft=2s,itl_p99=200ms"]
CELLS = {"long-0.12": [*LONG, "--rate", "0.12"], "long-0.2": [*LONG, "--rate", "0.2"],
         "short-0.3": [*SHORT, "--rate", "0.3"], "short-0.6": [*SHORT, "--rate", "0.6"]}
FIGURES = {"ttft_p90_ms": ("ttft_ms", "p90"), "itl_p99_ms": ("itl_ms", "p99"), "goodput_rps": ("goodput_rps", None)}
WITHIN = 0.25


def default_profiles() -> list[Path]:
    from tandem.engine.hardware.cpu_features import cpu_features

    kind = "avx512" if "avx512f" in cpu_features().flags else "avx2"
    return [ROOT / f"deploy/profiles/cpu-2core-{kind}-bench-{mode}.json" for mode in ("disaggregated", "colocated")]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(text: str, sent, warm, slo, rate: float, label: str, quiet: bool) -> dict:
    """Starts the manifest (text) as a local cluster, warms it up, sends `sent`, stops it; the run's summary."""
    from tandem.bench.manifests import local_cluster, measured
    from tandem.bench.loadgen import runner, stats
    from tandem.bench.loadgen.backends import GrpcBackend
    from tandem.cluster.manifest_yaml import parse_manifest

    with local_cluster(measured(parse_manifest(text, label))) as cluster:
        async def load():
            backend = GrpcBackend(cluster.endpoint, timeout_s=600)
            try:
                await runner.warm_up(warm, backend, len(warm))
                return await runner.open_loop(sent, backend, label=label, quiet=quiet)
            finally:
                await backend.aclose()

        records = asyncio.run(load())
    return stats.summarize(records, slo, asked_rate=rate)


def compare(predicted: dict, summary: dict) -> dict:
    out = {}
    for name, (key, sub) in FIGURES.items():
        value = summary[key] if sub is None else summary[key][sub]
        want = predicted[name]
        ratio = want / value if value and want is not None else None
        out[name] = {"predicted": want, "measured": value, "ratio": ratio,
                     "within": ratio is not None and abs(ratio - 1) <= WITHIN or (value == want == 0)}
    return out


def check_cell(name: str, flags: list[str], args) -> dict:
    from tandem.bench.loadgen import stats
    from tandem.bench.loadgen.command import conversations, workload_config
    from tandem.bench.loadgen.workloads import PromptMaker, build
    from tandem.cluster.cli import build_parser
    from tandem.cluster.hardware_profile import read_profile
    from tandem.cluster.planner import Planner, manifest_text
    from tandem.engine.loader.model_info import load_model_info

    duration = ["--duration", str(args.duration)] if args.duration else []
    plan_args = build_parser().parse_args(["plan", *[f for p in args.profiles for f in ("--profile", str(p))],
                                           *flags, *duration])
    slo = stats.parse_slo(plan_args.slo)
    info = load_model_info(None)
    maker = PromptMaker(info.tokenizer, info.config.vocab_size)
    sent = conversations(plan_args, maker, plan_args.rate)
    warm = build(replace(workload_config(plan_args), seed=plan_args.seed - 1), maker, [None] * 2)  # tandem bench's
    profiles = [read_profile(p) for p in args.profiles]
    ranked = Planner(profiles, sent, plan_args.rate, slo, args.budget, log if not args.quiet else lambda _: None).plan()
    chosen = ranked[0]
    rival = next((p for p in ranked if p.option.shape.mode != chosen.option.shape.mode), None)
    rows = []
    for role, prediction in (("chosen", chosen), ("rival", rival)):
        if prediction is None:
            continue
        label = f"{name} {role}: {prediction.option.describe()}"
        log(f"== {label}")
        summary = measure(manifest_text(prediction, [label]), sent, warm, slo, plan_args.rate, label, args.quiet)
        row = {"role": role, **prediction.figures(), "compared": compare(prediction.figures(), summary),
               "measured_completed": summary["completed"], "measured_attainment": summary["slo_attainment"]}
        log("   " + ", ".join(f"{k} predicted {v['predicted']:.3g} measured {v['measured'] or 0:.3g}"
                               for k, v in row["compared"].items()))
        rows.append(row)
    goodputs = [r["compared"]["goodput_rps"]["measured"] for r in rows]
    return {"cell": name, "flags": flags, "rows": rows, "choice_best": goodputs[0] >= max(goodputs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of {', '.join(CELLS)}")
    p.add_argument("--profiles", nargs="+", default=None, help="default: the bench profiles of this CPU kind")
    p.add_argument("--budget", type=int, default=2, help="cores (default 2)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals in every cell (default: the "
                                                                "cell's, 60 or 120)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON there")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    unknown = [c for c in args.cells.split(",") if c not in CELLS]
    if unknown:
        p.error(f"unknown cell {unknown[0]!r}; cells: {', '.join(CELLS)}")
    args.profiles = args.profiles or default_profiles()
    started = time.perf_counter()
    cells = [check_cell(c, CELLS[c], args) for c in args.cells.split(",")]
    figures = [v for cell in cells for row in cell["rows"] for v in row["compared"].values()]
    result = {"machine": machine_line(), "cells": cells, "within_25": sum(f["within"] for f in figures),
              "figures": len(figures), "choice_best": sum(c["choice_best"] for c in cells),
              "seconds": time.perf_counter() - started}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
