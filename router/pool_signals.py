"""What the router measures per pool for the autoscaler (cluster/autoscaling.py): recent latencies against the
SLOs, the work queued and in flight, and how fast replicas got through it. Serving (and the benchmarks' in-process
backend) reports each request's progress here; the control plane asks for a PoolLoad per pool once a tick.

Latencies are kept for the last window_s seconds (percentiles over that window). Prefill latency is TTFT less the
wait for a decode reservation, so a decode pool short of KV does not make the prefill pool grow. Prefill rate:
uncached prompt tokens the prefill pool computed in the window, divided by the seconds its replicas were busy (a
replica is busy while it holds at least one of those prefills), so it measures what a busy replica does, not how
much work arrived.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from tandem.router.lifecycle import Progress
from tandem.router.replicas import Replica
from tandem.router.routing import PREFILL_POOL


@dataclass(frozen=True)
class PoolLoad:
    """One pool as the router saw it over its window. Seconds, tokens and counts; None: nothing measured.

    ttft_p90: arrival to first token of requests whose first token came in the window; prefill_p90: the same less
    the wait for decode room; queue_p90: that wait; itl_p90: gaps between later tokens. prefill_tokens: uncached
    tokens computed by this (prefill) pool in the window; prefill_busy_s: replica-seconds busy with them;
    prefill_prompt_tokens: the whole prompts of those prefills (cached tokens included). arrived_tokens: prompt
    tokens of every request that arrived at the router in the last rate_window_s (whichever pool it will use;
    a shorter window than the latencies', so that a step in the load shows in full soon); arrived_output_tokens:
    the output tokens they asked for (max_tokens x n); output_share: of the output tokens asked for by requests
    that finished in the window, the share generated (stops end requests early; None: none finished).
    started_requests: requests that got their first token in the last rate_window_s (any pool).
    arrived_requests / refused_requests: requests admitted / refused at once for lack of capacity
    (router/admission.py) in the last rate_window_s: demand the pools did not see as tokens, but should grow for.
    queued_prefill_tokens: sent and not answered yet. in_flight: requests on the pool's replicas; queued: requests
    waiting for a decode reservation (decode pool). kv_usage: mean fraction of KV blocks in use (last polls).
    decoding: requests past their first token and not finished, over the pool's replicas (a decode replica's
    in_flight also counts requests whose blocks it reserved and whose prefill has not answered yet: those wait, they do
    not make its steps slower). token_weighted_decoding: sum of decoding^2 / sum of decoding over the replicas: the
    requests sharing a replica with a typical token (what an ITL percentile over all tokens sees when replicas are
    unevenly loaded, e.g. right after new ones joined). itl_points: per decode replica with enough tokens in the
    last recent_s, (its requests decoding now, its ITL median over recent_s): what one replica's step costs at its
    batch. first_tokens: requests that got their first token in the window. upstream (decode pool): requests
    admitted that the pool has not begun decoding (waiting at the router for a prefill replica or for decode room,
    or being prefilled): decode work on its way."""

    pool: str
    replicas: int
    window_s: float
    ttft_p90: float | None = None
    prefill_p90: float | None = None
    queue_p90: float | None = None
    itl_p90: float | None = None
    itl_recent_p50: float | None = None
    prefill_tokens: int = 0
    prefill_busy_s: float = 0.0
    prefill_prompt_tokens: int = 0
    arrived_tokens: int = 0
    arrived_requests: int = 0
    refused_requests: int = 0
    started_requests: int = 0
    arrived_output_tokens: int = 0
    output_share: float | None = None
    rate_window_s: float = 5.0
    queued_prefill_tokens: int = 0
    in_flight: int = 0
    queued: int = 0
    upstream: int = 0
    kv_usage: float | None = None
    first_tokens: int = 0
    decoding: int = 0
    token_weighted_decoding: float = 0.0
    itl_points: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PoolScaling:
    """What the control plane reports of one pool's scaling, for the router's /metrics: replicas desired and
    ready, pending (placing or starting), draining; the last decision that changed something (action "" before
    any), why, and how many such decisions there were; pinned: the count `tandem scale` holds it at (None:
    automatic); shortfall: replicas Ray could not place."""

    pool: str
    desired: int
    ready: int
    pending: int
    draining: int
    decisions: int = 0
    last_action: str = ""
    last_reason: str = ""
    pinned: int | None = None
    shortfall: int = 0


MIN_POINT_GAPS = 8  # tokens a replica must have produced in recent_s for its ITL median to count


class _Window:
    """(time, value) pairs of the last window_s seconds."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.items: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self.items.append((t, value))

    def values(self, now: float) -> list[float]:
        while self.items and self.items[0][0] < now - self.window_s:
            self.items.popleft()
        return [v for _, v in self.items]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100, nearest rank) of values; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


class PoolSignals:
    def __init__(self, *, window_s: float = 10.0, rate_window_s: float = 5.0,
                 recent_s: float = 1.0, clock: Callable[[], float] = time.monotonic, max_gaps: int = 50_000):
        """max_gaps: inter-token gaps kept at most (the newest), so a flood of tokens costs bounded memory."""
        self.window_s, self.rate_window_s, self.clock = window_s, min(rate_window_s, window_s), clock
        self.recent_s = min(recent_s, window_s)
        self._ttft = {pool: _Window(window_s) for pool in ("prefill", "decode")}
        self._prefill_latency = _Window(window_s)
        self._queue = _Window(window_s)
        self._gaps: deque[tuple[float, float, str]] = deque(maxlen=max_gaps)  # (time, gap, decode replica)
        self._prefills: deque[tuple[float, float, str, int, int]] = deque()  # start, end, replica, uncached, all
        self._arrivals = _Window(self.rate_window_s)
        self._asked = _Window(self.rate_window_s)
        self._refused = _Window(self.rate_window_s)
        self._started = _Window(self.rate_window_s)  # first tokens (any route)
        self._finished: deque[tuple[float, int, int]] = deque()  # (time, generated, asked)
        self._decoding: dict[str, int] = {}  # decode replica -> requests decoding there

    def refused(self, count: int, now: float | None = None) -> None:
        """count requests were refused at once because the cluster could not start them in time."""
        self._refused.add(self.clock() if now is None else now, count)

    def arrived(self, prompt_tokens: int, output_tokens: int, now: float | None = None) -> None:
        """A request with this many prompt tokens, asking for at most output_tokens (max_tokens x n), arrived
        (counted before it is routed)."""
        now = self.clock() if now is None else now
        self._arrivals.add(now, prompt_tokens)
        self._asked.add(now, output_tokens)

    def finished(self, generated: int, asked: int, decode_replica: str, *, ok: bool = True,
                 now: float | None = None) -> None:
        """A request ended (however: ok False for an error or a cancel) having generated this many of the output
        tokens it asked for; decode_replica: where it decoded ("" if it never got a first token)."""
        if ok:
            self._finished.append((self.clock() if now is None else now, generated, asked))
        if decode_replica and self._decoding.get(decode_replica, 0) > 0:
            self._decoding[decode_replica] -= 1

    def first_token(self, progress: Progress, arrival: float, now: float | None = None) -> None:
        """A request's first progress (the one that carries its route and timings) arrived at `now`."""
        now = self.clock() if now is None else now
        ttft = now - arrival
        pool = "prefill" if progress.prefill_route == PREFILL_POOL else "decode"
        self._ttft[pool].add(now, ttft)
        self._started.add(now, 1)
        self._prefill_latency.add(now, max(0.0, ttft - progress.queue_s))
        self._queue.add(now, progress.queue_s)
        if progress.prefill_route == PREFILL_POOL and progress.outputs:
            output = progress.outputs[0]
            uncached = max(1, output.num_prompt_tokens - (progress.num_cached_tokens or 0))
            start = now - progress.prefill_s
            self._prefills.append((start, start + progress.prefill_s - progress.admission_s,
                                   progress.prefill_replica, uncached, output.num_prompt_tokens))

    def gaps(self, gaps: list[float], replica: str, now: float | None = None) -> None:
        """Inter-token gaps (seconds) a request's progress showed at `now`; replica: where it decodes."""
        now = self.clock() if now is None else now
        self._gaps.extend((now, g, replica) for g in gaps)

    def observe(self, progress: Progress, arrival: float, gaps: list[float], now: float, replica: str) -> None:
        """Both of the above for one progress (the serving paths call this with the accounting's gaps and the
        decode replica the request's first progress named)."""
        if progress.prefill_route:
            self.first_token(progress, arrival, now)
            if replica:
                self._decoding[replica] = self._decoding.get(replica, 0) + 1
        if gaps:
            self.gaps(gaps, replica, now)

    def load(self, pool: str, replicas: list[Replica], *, queued: int = 0, waiting: int = 0,
             waiting_tokens: int = 0) -> PoolLoad:
        """The pool's PoolLoad now, over the replicas routed to in it. queued: requests waiting for a decode
        reservation (the driver's num_queued), counted against the decode pool. waiting: requests waiting at the
        router for a prefill replica (the driver's num_waiting_prefill; decode pool). waiting_tokens: uncached prompt
        tokens of requests waiting at the router for a prefill replica (late binding), counted as the prefill
        pool's queue like the tokens sent to its replicas."""
        now = self.clock()
        start = now - self.window_s
        while self._prefills and self._prefills[0][1] < start:
            self._prefills.popleft()
        while self._gaps and self._gaps[0][0] < start:
            self._gaps.popleft()
        while self._finished and self._finished[0][0] < start:
            self._finished.popleft()
        asked = sum(a for _, _, a in self._finished)
        gaps = [g for _, g, _ in self._gaps]
        recent: dict[str, list[float]] = {}
        for t, g, replica in self._gaps:
            if t >= now - self.recent_s:
                recent.setdefault(replica, []).append(g)
        for name in [n for n in self._decoding if n not in {r.name for r in replicas}]:
            if not self._decoding[name]:
                del self._decoding[name]  # a replica that left, once its requests ended
        decoding = [self._decoding.get(r.name, 0) for r in replicas]
        loads = {r.name: self._decoding.get(r.name, 0) for r in replicas}
        points = tuple((loads[name], percentile(values, 50)) for name, values in recent.items()
                       if name in loads and len(values) >= MIN_POINT_GAPS)
        kv = [1.0 - r.load.kv_blocks_free / r.info.kv_blocks_total for r in replicas
              if r.info is not None and r.info.kv_blocks_total and r.load.kv_blocks_free is not None]
        ttft = self._ttft[pool].values(now)
        load = PoolLoad(pool, len(replicas), self.window_s, ttft_p90=percentile(ttft, 90),
                        arrived_tokens=int(sum(self._arrivals.values(now))), rate_window_s=self.rate_window_s,
                        arrived_requests=len(self._arrivals.values(now)),
                        refused_requests=int(sum(self._refused.values(now))),
                        started_requests=len(self._started.values(now)),
                        arrived_output_tokens=int(sum(self._asked.values(now))),
                        output_share=sum(g for _, g, _ in self._finished) / asked if asked else None,
                        in_flight=sum(r.load.in_flight for r in replicas), first_tokens=len(ttft),
                        decoding=sum(decoding), token_weighted_decoding=_token_weighted(decoding),
                        kv_usage=sum(kv) / len(kv) if kv else None)
        if pool == "prefill":
            done = [p for p in self._prefills if p[1] >= start]
            return replace(load, prefill_p90=percentile(self._prefill_latency.values(now), 90),
                            prefill_tokens=sum(p[3] for p in done), prefill_prompt_tokens=sum(p[4] for p in done),
                            prefill_busy_s=_busy_seconds(done, start),
                            queued_prefill_tokens=sum(r.load.queued_prefill_tokens for r in replicas) + waiting_tokens)
        return replace(load, queue_p90=percentile(self._queue.values(now), 90),
                        itl_recent_p50=percentile([g for v in recent.values() for g in v], 50), itl_points=points,
                        itl_p90=percentile(gaps, 90), queued=queued,
                        upstream=waiting + queued + max(0, load.in_flight - load.decoding),
                        prefill_p90=percentile(self._prefill_latency.values(now), 90))


def _token_weighted(counts: list[int]) -> float:
    total = sum(counts)
    return sum(c * c for c in counts) / total if total else 0.0


def _busy_seconds(prefills: list[tuple[float, float, str, int, int]], start: float) -> float:
    """Replica-seconds since start during which each replica held at least one of these prefills."""
    total = 0.0
    by_replica: dict[str, list[tuple[float, float]]] = {}
    for begin, end, replica, *_ in prefills:
        by_replica.setdefault(replica, []).append((max(begin, start), end))
    for intervals in by_replica.values():
        intervals.sort()
        cur_begin, cur_end = intervals[0]
        for begin, end in intervals[1:]:
            if begin > cur_end:
                total += cur_end - cur_begin
                cur_begin, cur_end = begin, end
            else:
                cur_end = max(cur_end, end)
        total += cur_end - cur_begin
    return total
