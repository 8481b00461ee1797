"""When disaggregation pays: the long-prompt mix at a sweep of rates against two deployments of the embedded model
with the same two cores, in one sitting, and the same comparison at 8-32 replicas per pool with the mock engine.

Part 1, real clusters (deploy/manifests/bench-disaggregated.yaml and bench-colocated.yaml): disaggregated runs a
prefill replica pinned to core 0 and a decode replica pinned to core 1, so a prefill never takes a decode step's
core; colocated runs one replica on both cores with chunked prefill (512 tokens a step beside the running decodes).
`tandem bench`'s open-loop generator (Poisson arrivals, latencies from the due times) sends short chats with a
--long-share of long prompts at each --rates rate for --duration seconds, through gRPC.

Part 2, scale (--scale 8,16,32): the router's real request driver over batched mock replicas
(router/mocks/batching.py) whose per-token prefill cost, decode step cost and KV bytes are measured on the real
model here (bench/disagg_scale.py): N prefill + N decode replicas against 2N colocated ones, at the same rates per
replica pair.

It writes the results folder (--out), the plots and, with --write-docs, the "Disaggregation" section of
docs/BENCHMARKS.md (between its markers). The last line of output is one JSON object with every number.

    .venv/bin/python bench/disagg_report.py [--rates 0.15,0.25,0.35] [--duration 120] [--scale 8,16,32] [--write-docs]

A local Ray head is started and stopped for each deployment; none may be running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.machine import cpu_report, machine_line  # noqa: E402
from tandem.bench.loadgen import report, runner, stats  # noqa: E402
from tandem.bench.loadgen.arrivals import ArrivalProcess  # noqa: E402
from tandem.bench.loadgen.workloads import PromptMaker, WorkloadConfig, build, parse_length  # noqa: E402

MODES = {"disaggregated": "bench-disaggregated.yaml", "colocated": "bench-colocated.yaml"}
START, END = "<!-- disagg-report:start -->", "<!-- disagg-report:end -->"


def workload(args) -> WorkloadConfig:
    return WorkloadConfig(kind="long-mix", input=parse_length(args.input), output=parse_length(args.output),
                          long_share=args.long_share, long_input=parse_length(args.long_input), seed=args.seed)


def conversations(args, maker, rate: float, duration_s: float):
    """The run at one rate: the same prompts and arrivals for both modes, other prompts at each rate (a rate's
    prompts must not hit the prefix cache the rate before left)."""
    seed = args.seed + 1 + round(1000 * rate)
    offsets = ArrivalProcess(rate, "poisson").offsets(duration_s=duration_s, seed=seed)
    return build(replace(workload(args), seed=seed), maker, offsets)


def run_cluster(mode: str, args, maker, slo) -> list[tuple[float, dict]]:
    """One deployment on a local Ray head this function starts and stops: a warm-up, then the sweep."""
    from tandem.bench.loadgen.backends import GrpcBackend
    from tandem.bench.manifests import local_cluster, manifest_to_measure

    with local_cluster(manifest_to_measure(MODES[mode]), "each mode gets the same cores") as cluster:
        async def sweep():
            backend = GrpcBackend(cluster.endpoint, timeout_s=600)
            try:
                # other prompts than the run's (another seed): warm paths and UCX connections, cold prefix caches
                first = build(replace(workload(args), seed=args.seed), maker, [0.0] * 40)
                warm = [c for c in first if c.requests[0].klass == "long"][:1] + \
                    [c for c in first if c.requests[0].klass == "short"][:2]
                await runner.warm_up(warm, backend, len(warm))
                points = []
                for rate in args.rates:
                    records = await runner.open_loop(conversations(args, maker, rate, args.duration), backend,
                                                     label=f"{mode} {rate:g} req/s", quiet=args.quiet)
                    points.append((rate, records))
                    await asyncio.sleep(args.pause)
                return points
            finally:
                await backend.aclose()

        points = asyncio.run(sweep())
    out = []
    for rate, records in points:
        summary = stats.summarize(records, slo, asked_rate=rate)
        report.write_run(args.out / mode / f"rate-{rate:g}", records, summary, {"mode": mode, "rate": rate})
        out.append((rate, summary))
        print(f"{mode} {rate:g} req/s: {headline(summary)}", file=sys.stderr, flush=True)
    return out


def run_scale(args, maker, slo) -> dict:
    """The mock engine at --scale replicas per pool, rates per replica pair as in part 1."""
    from tandem.bench import disagg_scale

    costs = disagg_scale.calibrate(max_num_batched_tokens=512, max_num_seqs=32)
    print(f"calibrated: {costs}", file=sys.stderr, flush=True)
    results: dict = {"costs": {k: getattr(costs, k) for k in costs.__dataclass_fields__}}
    for replicas in args.scale:
        for mode in MODES:
            points = []
            for rate in args.rates:
                records = asyncio.run(scale_run(
                    mode, replicas, costs, conversations(args, maker, rate * replicas, args.scale_duration),
                    args.quiet))
                summary = stats.summarize(records, slo, asked_rate=rate * replicas)
                points.append((rate * replicas, summary))
                print(f"scale {replicas} {mode} {rate * replicas:g} req/s: {headline(summary)}", file=sys.stderr,
                      flush=True)
            results.setdefault(str(replicas), {})[mode] = points
    return results


async def scale_run(mode: str, replicas: int, costs, convs, quiet: bool):
    """One open-loop run through the router's request driver over a fresh mock deployment."""
    from tandem.bench import disagg_scale
    from tandem.cluster.simulation import serve

    return await serve(disagg_scale.build_deployment(mode, replicas, costs), convs, label=f"scale {replicas} {mode}",
                       quiet=quiet)


def headline(summary: dict) -> str:
    return (f"ITL p99 {fmt(summary['itl_ms']['p99'])} ms, TTFT p90 {fmt(summary['ttft_ms']['p90'])} ms, "
            f"goodput {summary['goodput_rps']:.3f} req/s ({100 * summary['slo_attainment']:.0f}%), "
            f"{summary['failed']} failed")


def fmt(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def compare(sweeps: dict, attainment: float) -> dict:
    """Per rate: the ratios the targets are about; and each mode's highest rate meeting the SLOs."""
    d, c = sweeps["disaggregated"], sweeps["colocated"]
    rows = []
    for (rate, ds), (_, cs) in zip(d, c):
        itl = ds["itl_ms"]["p99"] / cs["itl_ms"]["p99"] if ds["itl_ms"]["p99"] and cs["itl_ms"]["p99"] else None
        good = ds["goodput_rps"] / cs["goodput_rps"] if cs["goodput_rps"] else None
        rows.append({"rate": rate, "itl_p99_ratio": itl, "goodput_ratio": good})
    return {"per_rate": rows, "max_rate": {mode: stats.max_rate_meeting(points, attainment)
                                           for mode, points in sweeps.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")], default=[0.15, 0.25, 0.35])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per rate (real clusters)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between rates")
    parser.add_argument("--input", default="lognormal:96,0.4", help="short chats' prompt tokens")
    parser.add_argument("--output", default="fixed:48", help="output tokens of every request")
    parser.add_argument("--long-share", type=float, default=0.15)
    parser.add_argument("--long-input", default="uniform:1024,1536", help="long prompts' tokens")
    parser.add_argument("--slo", default="ttft=20s,itl_p99=500ms")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--scale", type=lambda s: [int(r) for r in s.split(",")] if s else [], default=[8, 16, 32])
    parser.add_argument("--scale-duration", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "disagg")
    parser.add_argument("--write-docs", action="store_true", help="rewrite docs/BENCHMARKS.md's section and plots")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--from-json", type=Path, default=None, metavar="REPORT_JSON",
                        help="no measuring: redo the plots and docs from an earlier run's report.json")
    args = parser.parse_args()

    slo = stats.parse_slo(args.slo)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = measure(args, slo)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    publish(result, args, slo)
    print(json.dumps(result, default=str))


def measure(args, slo) -> dict:
    from tandem.engine.loader.model_info import load_model_info

    info = load_model_info(None)
    maker = PromptMaker(info.tokenizer, info.config.vocab_size)
    started = time.perf_counter()
    sweeps = {}
    for mode in MODES:
        print(f"== {mode}", file=sys.stderr, flush=True)
        sweeps[mode] = run_cluster(mode, args, maker, slo)
    scale = run_scale(args, maker, slo) if args.scale else {}
    return {"machine": machine_line(), "cpu": cpu_report(), "workload": vars(workload(args)) | {
        "input": args.input, "output": args.output, "long_input": args.long_input}, "slo": args.slo,
        "rates": args.rates, "duration_s": args.duration, "attainment": args.attainment,
        "compare": compare(sweeps, args.attainment), "sweeps": sweeps, "scale": scale,
        "wall_s": time.perf_counter() - started}


def publish(result: dict, args, slo) -> None:
    """The plots (into docs/images with --write-docs, else the results folder) and the docs section."""
    images = ROOT / "docs" / "images" if args.write_docs else args.out
    images.mkdir(parents=True, exist_ok=True)
    report.plot_modes(images / "disagg_sweep.png", result["sweeps"], slo,
                      "2 cores, embedded model: disaggregated vs colocated")
    for replicas, modes in result["scale"].items():
        if replicas != "costs":
            report.plot_modes(images / f"disagg_scale_{replicas}.png", modes, slo,
                              f"mock engine, {replicas} replicas per pool (calibrated costs)")
    if args.write_docs:
        from bench.disagg_markdown import write_section

        write_section(ROOT / "docs" / "BENCHMARKS.md", result, START, END)

if __name__ == "__main__":
    main()
