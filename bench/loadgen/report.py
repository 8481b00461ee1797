"""A run's results on disk: per-request JSONL, the summary JSON, and PNG plots (matplotlib, Agg backend, loaded
only when plotting)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tandem.bench.loadgen.records import RequestRecord
from tandem.bench.loadgen.stats import SLO, RequestMetrics


def write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))


def read_records(path: Path) -> list[RequestRecord]:
    """Raises ValueError naming the file and line of a row that is not a record."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(RequestRecord.from_json(json.loads(line)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if values_ms:
        ordered = sorted(values_ms)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_latency_cdfs(path: Path, records: Sequence[RequestRecord]) -> None:
    """TTFT, TPOT, ITL and end-to-end CDFs, one line per request class and one for all."""
    plt = _pyplot()
    done = [r for r in records if r.ok and r.first_token_s is not None]
    classes = sorted({r.klass for r in done})
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, get) in zip(axes.flat, (
            ("TTFT", lambda m: [m.ttft_s]), ("TPOT", lambda m: [m.tpot_s] if m.tpot_s is not None else []),
            ("ITL (every gap)", lambda m: list(m.itl_s)), ("end to end", lambda m: [m.e2e_s]))):
        groups = [("all", done)] + ([(k, [r for r in done if r.klass == k]) for k in classes] if len(classes) > 1
                                    else [])
        for label, rs in groups:
            _cdf(ax, [1000 * v for r in rs for v in get(RequestMetrics.of(r))], label)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if "ITL" not in title else "fraction of gaps")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_itl_timeline(path: Path, records: Sequence[RequestRecord]) -> None:
    """Every inter-token gap at the time it ended (by class), with each request's due time marked below."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    classes = sorted({r.klass for r in records})
    for k, klass in enumerate(classes):
        mine = [r for r in records if r.klass == klass]
        xs, ys = [], []
        for r in mine:
            for a, b in zip(r.token_times_s, r.token_times_s[1:]):
                xs.append(b)
                ys.append(1000 * (b - a))
        color = f"C{k}"
        ax.scatter(xs, ys, s=4, color=color, label=f"{klass} gaps", alpha=0.6)
        ax.plot([r.scheduled_s for r in mine], [0] * len(mine), "|", color=color, markersize=16 if klass == "long" else 8,
                transform=ax.get_xaxis_transform(), label=f"{klass} arrivals")
    ax.set(xlabel="seconds since start", ylabel="inter-token gap (ms)", title="ITL over time")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_run(folder: Path, records: Sequence[RequestRecord], summary: dict, config: dict) -> list[Path]:
    """requests.jsonl, summary.json (with config under "config") and the two plots; returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "requests.jsonl", folder / "summary.json", folder / "latency_cdf.png",
             folder / "itl_timeline.png"]
    write_records(paths[0], records)
    paths[1].write_text(json.dumps(summary | {"config": config}, indent=1, default=str))
    plot_latency_cdfs(paths[2], records)
    plot_itl_timeline(paths[3], records)
    return paths


def write_sweep(folder: Path, points: Sequence[tuple[float, dict]], slo: SLO) -> list[Path]:
    """sweep.json and sweep.png: throughput and goodput against the asked rate, and SLO attainment."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text(json.dumps([{"rate": r} | s for r, s in points], indent=1, default=str))
    rates = [r for r, _ in points]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax.plot(rates, [s["request_throughput"] for _, s in points], "o-", label="throughput")
    ax.plot(rates, [s["goodput_rps"] for _, s in points], "s-", label=f"goodput ({slo.describe()})")
    ax.plot(rates, rates, ":", color="grey", label="asked")
    ax.set(xlabel="asked rate (req/s)", ylabel="req/s", title="throughput and goodput")
    bx.plot(rates, [100 * s["slo_attainment"] for _, s in points], "o-")
    bx.set(xlabel="asked rate (req/s)", ylabel="% of requests within SLO", title="SLO attainment", ylim=(0, 105))
    for axis in (ax, bx):
        axis.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "sweep.png", dpi=90)
    plt.close(fig)
    return [folder / "sweep.json", folder / "sweep.png"]


def plot_modes(path: Path, sweeps: dict[str, Sequence[tuple[float, dict]]], slo: SLO, title: str) -> None:
    """ITL p99, TTFT p90 and goodput against rate, one line per deployment mode, SLO limits dashed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("ITL p99 (ms)", lambda s: s["itl_ms"]["p99"], slo.itl_p99),
              ("TTFT p90 (ms)", lambda s: s["ttft_ms"]["p90"], slo.ttft),
              ("goodput (req/s)", lambda s: s["goodput_rps"], None))
    for ax, (label, get, limit) in zip(axes, panels):
        for mode, points in sweeps.items():
            ax.plot([r for r, _ in points], [get(s) for _, s in points], "o-", label=mode)
        if limit is not None:
            ax.axhline(1000 * limit, linestyle="--", color="grey", label="SLO")
        ax.set(xlabel="rate (req/s)", ylabel=label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
