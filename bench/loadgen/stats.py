"""Latency statistics, SLOs and goodput over a run's RequestRecords. Pure arithmetic, no I/O.

Definitions (the same as vLLM's `bench serve`, so numbers compare):
- TTFT: first token's arrival - the request's due time (scheduled_s, not sent_s: lateness counts).
- TPOT: (end to end - TTFT) / (output tokens - 1); undefined for a single output token.
- ITL: every gap between consecutive streamed messages carrying tokens; a message carrying several tokens is one
  gap (the gap its tokens waited), as vLLM counts chunks.
- Throughput: completed requests (and tokens) per second of the run, from the first due time to the last end.
- Goodput: requests per second that completed within every SLO given (DistServe's per-run definition);
  attainment: that count over all requests, failed ones included as misses. For a rate sweep,
  max_rate_meeting() gives DistServe's other notion: the highest rate whose attainment reaches a target.
Percentiles interpolate linearly between order statistics (numpy.percentile's default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import numpy as np

from tandem.bench.loadgen.records import RequestRecord


def describe(values: Iterable[float]) -> dict:
    """count, mean, p50, p90, p99, max of values (None for all but count when empty)."""
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return {"count": int(data.size), "mean": float(data.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(data.max())}


@dataclass(frozen=True)
class SLO:
    """Per-request limits in seconds (None: no limit). itl_p99 / itl_max: the request's own p99 / largest gap."""

    ttft: float | None = None
    tpot: float | None = None
    itl_p99: float | None = None
    itl_max: float | None = None
    e2e: float | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def describe(self) -> str:
        return ", ".join(f"{f.name} <= {1000 * getattr(self, f.name):g} ms" for f in fields(self)
                         if getattr(self, f.name) is not None) or "no SLO"


_LIMIT = re.compile(r"^\s*([a-z_0-9]+)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|s)\s*$")


def parse_slo(text: str | None) -> SLO:
    """`ttft=2s,itl_p99=200ms,tpot=50ms,e2e=10s` (units required). Empty or None: no SLO. Raises ValueError for
    an unknown name or a value without its unit."""
    if not text:
        return SLO()
    known = [f.name for f in fields(SLO)]
    limits = {}
    for part in text.split(","):
        match = _LIMIT.match(part)
        if match is None:
            raise ValueError(f"bad SLO {part.strip()!r}: write NAME=VALUE with a unit, e.g. ttft=2s or "
                             f"itl_p99=200ms")
        name, value, unit = match.groups()
        if name not in known:
            raise ValueError(f"unknown SLO {name!r}; known: {', '.join(known)}")
        limits[name] = float(value) / (1000.0 if unit == "ms" else 1.0)
    return SLO(**limits)


@dataclass(frozen=True)
class RequestMetrics:
    """One successful request's latencies in seconds (tpot None with fewer than 2 output tokens)."""

    ttft_s: float
    e2e_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]
    pacing_s: float

    @classmethod
    def of(cls, record: RequestRecord) -> RequestMetrics:
        """Raises ValueError for a record that did not complete (record.ok false): it has no latencies."""
        if not record.ok or record.first_token_s is None:
            raise ValueError(f"request {record.index} did not complete ({record.error or 'no tokens'})")
        ttft = record.first_token_s - record.scheduled_s
        e2e = record.end_s - record.scheduled_s
        tpot = (e2e - ttft) / (record.output_tokens - 1) if record.output_tokens > 1 else None
        times = record.token_times_s
        return cls(ttft, e2e, tpot, tuple(b - a for a, b in zip(times, times[1:])),
                   (record.sent_s if record.sent_s is not None else record.scheduled_s) - record.scheduled_s)

    @property
    def itl_p99_s(self) -> float | None:
        return float(np.percentile(self.itl_s, 99)) if self.itl_s else None


def meets(slo: SLO, m: RequestMetrics) -> bool:
    """Every limit slo gives holds for m (a request with no gaps passes the ITL and TPOT limits)."""
    checks = ((slo.ttft, m.ttft_s), (slo.e2e, m.e2e_s), (slo.tpot, m.tpot_s), (slo.itl_p99, m.itl_p99_s),
              (slo.itl_max, max(m.itl_s) if m.itl_s else None))
    return all(limit is None or value is None or value <= limit for limit, value in checks)


def _ms(values: Iterable[float]) -> dict:
    return describe(1000.0 * v for v in values)


def _latencies(metrics: Sequence[RequestMetrics]) -> dict:
    return {"ttft_ms": _ms(m.ttft_s for m in metrics), "tpot_ms": _ms(m.tpot_s for m in metrics if m.tpot_s is not None),
            "itl_ms": _ms(g for m in metrics for g in m.itl_s), "e2e_ms": _ms(m.e2e_s for m in metrics)}


def _server_timings(records: Sequence[RequestRecord]) -> dict:
    keys = sorted({k for r in records for k in r.server_timings})
    return {k: _ms(r.server_timings[k] for r in records if k in r.server_timings) for k in keys}


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None, *, asked_rate: float | None = None,
              duration_s: float | None = None) -> dict:
    """The run's summary as JSON-ready values (see the module docstring for the definitions). duration_s: the
    run's length for throughputs (default: first due time to the last end or send)."""
    slo = slo or SLO()
    done = [r for r in records if r.ok and r.first_token_s is not None]
    metrics = {r.index: RequestMetrics.of(r) for r in done}
    good = [r for r in done if meets(slo, metrics[r.index])]
    if duration_s is None:
        ends = [t for r in records for t in (r.end_s, r.sent_s) if t is not None]
        duration_s = (max(ends) - min(r.scheduled_s for r in records)) if records and ends else 0.0
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "incomplete"] = errors.get(r.error or "incomplete", 0) + 1
    sent = sorted(r.sent_s for r in records if r.sent_s is not None)
    reporting = [r for r in done if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reporting)
    by_class = {}
    for klass in sorted({r.klass for r in records}):
        mine = [r for r in records if r.klass == klass]
        mine_done = [metrics[r.index] for r in mine if r.index in metrics]
        by_class[klass] = {"requests": len(mine), "completed": len(mine_done),
                           "slo_attainment": sum(1 for r in good if r.klass == klass) / len(mine),
                           **_latencies(mine_done), "server_timings_ms": _server_timings([r for r in mine if r.ok])}
    return {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done), "errors": errors,
        **_latencies(list(metrics.values())), "duration_s": duration_s,
        "request_throughput": per_s(len(done)),
        "output_token_throughput": per_s(sum(r.output_tokens for r in done)),
        "total_token_throughput": per_s(sum(r.output_tokens + r.prompt_tokens for r in done)),
        "goodput_rps": per_s(len(good)), "slo": slo.describe(),
        "slo_attainment": len(good) / len(records) if records else 0.0,
        "prefix_hit_rate": sum(r.cached_tokens for r in reporting) / prompt if prompt else None,
        "asked_rate": asked_rate,
        "achieved_rate": (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else None,
        "pacing_ms": _ms((r.sent_s - r.scheduled_s) for r in records if r.sent_s is not None),
        "by_class": by_class,
    }


def max_rate_meeting(points: Sequence[tuple[float, dict]], attainment: float = 0.9) -> float | None:
    """The highest asked rate of a sweep whose SLO attainment reaches attainment (None when none does)."""
    rates = [rate for rate, summary in points if rate is not None and summary["slo_attainment"] >= attainment]
    return max(rates) if rates else None
