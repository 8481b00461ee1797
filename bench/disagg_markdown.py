"""The "Disaggregation" section of docs/BENCHMARKS.md, written from bench/disagg_report.py's results: the
command, machine and workload, each mode's latency and goodput at each rate, the ratios the targets are about,
where each request class's time went, the plots, and the mock-engine rows at scale."""

from __future__ import annotations

from pathlib import Path


def _f(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _mode_rows(sweeps: dict) -> list[str]:
    rows = ["| rate (req/s) | mode | completed | ITL p99 (ms) | TTFT p90 (ms) | TPOT mean (ms) | goodput (req/s) "
            "| SLO attainment | errors |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, (rate, _) in enumerate(next(iter(sweeps.values()))):
        for mode, points in sweeps.items():
            s = points[i][1]
            rows.append(f"| {rate:g} | {mode} | {s['completed']}/{s['requests']} | {_f(s['itl_ms']['p99'])} | "
                        f"{_f(s['ttft_ms']['p90'])} | {_f(s['tpot_ms']['mean'])} | {_f(s['goodput_rps'], 3)} | "
                        f"{_f(100 * s['slo_attainment'])}% | {s['errors'] or 'none'} |")
    return rows


def _ratio_rows(compare: dict) -> list[str]:
    rows = ["| rate (req/s) | ITL p99, disaggregated / colocated (target <= 0.33) | goodput, disaggregated / "
            "colocated (target >= 1.5) |", "| --- | --- | --- |"]
    for row in compare["per_rate"]:
        good = "colocated 0" if row["goodput_ratio"] is None else f"{row['goodput_ratio']:.2f}x"
        rows.append(f"| {row['rate']:g} | {_f(row['itl_p99_ratio'], 2)} | {good} |")
    return rows


def _class_rows(sweeps: dict) -> list[str]:
    """Where each class's time went at each mode's highest rate, from the router's own timings (means, ms)."""
    rows = ["| mode | class | requests | queue | prefill compute | KV transfer tail | admission | TTFT p50 / p90 | "
            "decode (e2e - TTFT) | ITL p99 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, points in sweeps.items():
        rate, summary = points[-1]
        for klass, c in sorted(summary["by_class"].items()):
            t = {k: (v or {}).get("mean") for k, v in c.get("server_timings_ms", {}).items()}
            compute = None if t.get("prefill_s") is None else \
                t["prefill_s"] - (t.get("transfer_s") or 0) - (t.get("admission_s") or 0)
            decode = None if c["e2e_ms"]["mean"] is None or c["ttft_ms"]["mean"] is None else \
                c["e2e_ms"]["mean"] - c["ttft_ms"]["mean"]
            rows.append(f"| {mode} ({rate:g} req/s) | {klass} | {c['requests']} | {_f(t.get('queue_s'))} | "
                        f"{_f(compute)} | {_f(t.get('transfer_s'))} | {_f(t.get('admission_s'))} | "
                        f"{_f(c['ttft_ms']['p50'])} / {_f(c['ttft_ms']['p90'])} | {_f(decode)} | "
                        f"{_f(c['itl_ms']['p99'])} |")
    return rows


def _scale_rows(scale: dict) -> list[str]:
    rows = ["| replicas per pool | rate (req/s) | ITL p99 disaggregated / colocated (ms) | TTFT p90 disaggregated / "
            "colocated (ms) | goodput disaggregated / colocated (req/s) | ITL p99 ratio | goodput ratio |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for replicas, modes in scale.items():
        if replicas == "costs":
            continue
        for (rate, d), (_, c) in zip(modes["disaggregated"], modes["colocated"]):
            itl = d["itl_ms"]["p99"] / c["itl_ms"]["p99"] if d["itl_ms"]["p99"] and c["itl_ms"]["p99"] else None
            good = f"{d['goodput_rps'] / c['goodput_rps']:.2f}x" if c["goodput_rps"] else "colocated 0"
            rows.append(f"| {replicas} | {rate:g} | {_f(d['itl_ms']['p99'])} / {_f(c['itl_ms']['p99'])} | "
                        f"{_f(d['ttft_ms']['p90'])} / {_f(c['ttft_ms']['p90'])} | {_f(d['goodput_rps'], 2)} / "
                        f"{_f(c['goodput_rps'], 2)} | {_f(itl, 2)} | {good} |")
    return rows


def section(result: dict) -> str:
    w = result["workload"]
    compare = result["compare"]
    best = compare["max_rate"]
    lines = [
        "## Disaggregation", "",
        "When does splitting prefill from decode pay on this machine? `bench/disagg_report.py` runs, in one "
        "sitting, `tandem bench`'s open-loop generator (Poisson arrivals, latencies from each request's due time) "
        "against two deployments of the embedded model on the same two cores: **disaggregated** "
        "(`deploy/manifests/bench-disaggregated.yaml`: a prefill replica pinned to core 0 and a decode replica "
        "pinned to core 1 with `cpu_affinity`, KV over UCX) and **colocated** (`bench-colocated.yaml`: one replica "
        "on both cores, two torch threads, prefill chunked at 512 tokens a step beside the running decodes). The "
        "router, Ray and the load generator are not pinned: they share the two cores in both runs.", "",
        f"    .venv/bin/python bench/disagg_report.py --write-docs "
        f"--rates {','.join(f'{r:g}' for r in result['rates'])} --duration {result['duration_s']:g}", "",
        f"Machine: {result['machine']}. Workload: short chats (`{w['input']}` prompt tokens) with a "
        f"{w['long_share']:g} share of long prompts (`{w['long_input']}` tokens), `{w['output']}` output tokens "
        f"each (greedy, ignore_eos), {result['duration_s']:g} s of arrivals per rate, seed {w['seed']}. SLOs: "
        f"`{result['slo']}` (per request: TTFT, and the p99 of its own inter-token gaps); goodput counts the "
        f"requests meeting both, per second (DistServe's definition). Wall time {result['wall_s'] / 60:.0f} min.",
        "", *_mode_rows(result["sweeps"]), "", *_ratio_rows(compare), "",
        f"Highest rate with at least {100 * result['attainment']:.0f}% of requests within the SLOs: "
        + ", ".join(f"{mode} {'none of the rates' if r is None else f'{r:g} req/s'}" for mode, r in best.items())
        + ".", "", "![ITL p99, TTFT p90 and goodput against rate](images/disagg_sweep.png)", "",
        "Where each class's time went at the highest rate, in ms (means of the router's own timings: queue is "
        "waiting for a replica with room; prefill compute is the prefill replica's queue and compute (the "
        "colocated replica's, with its decodes); the KV transfer tail is what layer-wise sending did not hide; "
        "admission is the decode replica taking the request into its batch; decode is end to end minus time to "
        "first token as the client saw it):", "", *_class_rows(result["sweeps"]), ""]
    if result.get("scale"):
        costs = result["scale"]["costs"]
        lines += [
            "### At 8-32 replicas per pool (mock engine)", "",
            "The same workload and SLOs through the router's real request driver over batched mock replicas "
            "(`router/mocks/batching.py`: one step loop per replica, chunked prefill beside decodes in colocated "
            "replicas) whose costs were measured on the real model in the same run (`bench/disagg_scale.py`: "
            + ", ".join(f"{k} {v:.3g}" for k, v in costs.items() if isinstance(v, (int, float))) +
            "). N prefill + N decode replicas against 2N colocated ones, the rate scaled by N.", "",
            *_scale_rows(result["scale"]), ""]
        lines += [f"![mock engine at {r} replicas per pool](images/disagg_scale_{r}.png)" for r in result["scale"]
                  if r != "costs"] + [""]
    return "\n".join(lines)


def write_section(path: Path, result: dict, start: str, end: str) -> None:
    """Replaces the text between the start and end markers of path (appends both, with the section, when the
    file has none)."""
    text = path.read_text()
    block = f"{start}\n{section(result)}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
