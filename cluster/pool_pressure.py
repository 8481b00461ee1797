"""From what the router measured of a pool (router/pool_signals.py PoolLoad) to what the autoscaling policy reads
(cluster/autoscaling.py PoolSample): the pool's pressure against its SLO and margins, and the replicas its work
needs. Plain Python; one PoolGauge per pool keeps what it learned of a replica's capacity between ticks.

Prefill pool (disaggregated):
  pressure = max(prefill latency p90 / (TTFT SLO x u), queued prefill tokens / (replicas x rate x TTFT SLO x u))
  needed   = (arriving + backlog / horizon) / (rate x u)
  where u is the target utilization, rate the uncached tokens a busy replica computes per second (measured,
  smoothed), arriving the prompt tokens arriving per second times the uncached share of the prefills done in
  the window (1 before any), backlog the queued tokens projected to when replicas started now would serve
  (queued + (arriving - replicas x rate) x start-up time, when positive) and horizon the time that backlog should
  take to clear once they do (the longer of the TTFT SLO and the start-up time). Arrivals, not completions: a
  saturated pool completes only what it can; requests refused at once for lack of capacity count as arrivals like
  the admitted ones (else admission control would hide the overload from the autoscaler). Sized so, a burst is
  absorbed about two start-up times after the decision, in one decision; the replicas added for the backlog leave
  once the pool has been under target for a down window.
Decode pool (and a colocated pool, which also answers for TTFT):
  pressure = max(ITL p90 / (ITL SLO x u), KV use / kv_high, needed / replicas (with an ITL SLO)
                 [, TTFT p90 / (TTFT SLO x u) when colocated])
  needed   = max((output tokens asked per second + coming / horizon) x share generated / (capacity / (u x ITL SLO)),
                 replicas x KV use x decoding share x (in flight + waiting for room) / in flight / kv_high)
  where coming is the output tokens asked by the requests admitted and not decoding yet (waiting for a prefill
  replica or decode room, or prefilling), projected like the prefill backlog to when replicas started now would
  serve (plus (requests arriving - requests starting to decode) per second x start-up time, when they arrive
  more than PILING times faster than they start: a pile-up, not noise): a
  prefill backlog reaches the decode pool as fast as the prefill pool clears it, within the horizon above; capacity / (u x ITL SLO) is the tokens per second one replica generates
  with its ITL at u x the ITL SLO,
  capacity the sequences it then holds: a line ITL = a + b x n fitted
  to (a replica's requests decoding, its ITL median over the last second), one point per replica and tick, with
  exponential forgetting; before the points spread, n x (u x SLO) / ITL with n the requests sharing a replica
  with a typical token (a latency floor makes this conservative: it asks for more); never above max_num_seqs.
The wait for decode room is logged but is no pressure of its own: room the decode pool lacks shows as KV use, and
the requests waiting for room ask for blocks like those in flight (the KV term of needed). A decode replica
reserves a request's blocks before its prefill, so a prefill backlog holds decode KV with requests that only
wait for their prefill: the KV term counts only the decoding share of the requests in flight (decoding / in
flight), so that a prefill backlog makes the prefill pool grow, not the decode pool. Decode is sized from the tokens
asked for, not from the sequences in flight: sequences stay longer when tokens
come slower, so the count in flight on an overloaded pool overstates what the pool needs at its target, and on a
generous one understates it (fewer replicas would hold them longer). Without an ITL SLO, sequences in flight and
waiting over capacity (max_num_seqs x u) stand in. A term whose SLO is not set is left out. With nothing
measured the pressure is None (an idle pool).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.cluster.autoscaling import PoolSample
from tandem.router.pool_signals import PoolLoad

MIN_BUSY_S = 0.5  # replica-seconds of prefill in a window before its rate is trusted
FORGET = 0.95  # per tick, how much of the ITL fit's past a tick keeps
PILING = 2.0  # requests arriving this many times faster than they start decoding: a pile-up, not noise


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    itl_s: float | None = None


class PoolGauge:
    def __init__(self, pool: str, slo: SLO, *, colocated: bool = False, target_utilization: float = 0.8,
                 kv_high: float = 0.8, max_num_seqs: int = 64, startup_s: float = 30.0):
        self.pool, self.slo, self.colocated = pool, slo, colocated
        self.u, self.kv_high, self.max_num_seqs = target_utilization, kv_high, max_num_seqs
        self.startup_s = startup_s  # how long a replica takes from decision to serving (actuators update it)
        self.prefill_rate: float | None = None  # uncached tokens per busy replica-second
        self._fit = [0.0] * 5  # forgetting sums: n, x, y, xx, xy

    def sample(self, load: PoolLoad, t: float, *, ready: int, starting: int = 0, draining: int = 0) -> PoolSample:
        if self.pool == "prefill" and not self.colocated:
            pressure, needed, inputs = self._prefill(load, ready)
        else:
            pressure, needed, inputs = self._decode(load, ready)
        return PoolSample(t, ready, starting, draining, pressure, needed, inputs)

    def _prefill(self, load: PoolLoad, ready: int) -> tuple[float | None, float | None, dict[str, float]]:
        if load.prefill_busy_s >= MIN_BUSY_S:
            rate = load.prefill_tokens / load.prefill_busy_s
            self.prefill_rate = rate if self.prefill_rate is None else 0.7 * self.prefill_rate + 0.3 * rate
        share = load.prefill_tokens / load.prefill_prompt_tokens if load.prefill_prompt_tokens else 1.0
        arriving = load.arrived_tokens / load.rate_window_s * share * _with_refused(load)
        inputs = {"queued_tokens": load.queued_prefill_tokens, "arriving_tokens_per_s": arriving}
        terms = []
        if self.slo.ttft_s and load.prefill_p90 is not None:
            terms.append(load.prefill_p90 / (self.slo.ttft_s * self.u))
            inputs["prefill_p90_s"] = load.prefill_p90
        needed = None
        if self.prefill_rate:
            inputs["rate_per_replica"] = self.prefill_rate
            if self.slo.ttft_s and ready:
                terms.append(load.queued_prefill_tokens / (ready * self.prefill_rate * self.slo.ttft_s * self.u))
            capacity = ready * self.prefill_rate
            backlog = load.queued_prefill_tokens + max(0.0, arriving - capacity) * self.startup_s
            horizon = max(self.slo.ttft_s or 0.0, self.startup_s, 1.0)
            needed = (arriving + backlog / horizon) / (self.prefill_rate * self.u)
        idle = load.first_tokens == 0 and load.queued_prefill_tokens == 0 and load.in_flight == 0
        return (None if idle or not terms else max(terms)), (0.0 if idle else needed), inputs

    def _decode(self, load: PoolLoad, ready: int) -> tuple[float | None, float | None, dict[str, float]]:
        inputs = {"in_flight": load.in_flight, "queued": load.queued}
        terms = []
        if load.kv_usage is not None:
            terms.append(load.kv_usage / self.kv_high)
            inputs["kv_usage"] = load.kv_usage
        if self.slo.itl_s and load.itl_p90 is not None:
            terms.append(load.itl_p90 / (self.slo.itl_s * self.u))
            inputs["itl_p90_s"] = load.itl_p90
        if load.queue_p90 is not None:
            inputs["queue_p90_s"] = load.queue_p90
        if self.colocated and self.slo.ttft_s and load.ttft_p90 is not None:
            terms.append(load.ttft_p90 / (self.slo.ttft_s * self.u))
            inputs["ttft_p90_s"] = load.ttft_p90
        seqs = load.in_flight + load.queued
        if seqs == 0 and load.first_tokens == 0:
            return None, 0.0, inputs
        capacity = self._capacity(load)
        inputs["seqs_per_replica"] = capacity
        if self.slo.itl_s:
            share = load.output_share if load.output_share is not None else 1.0
            asked = load.arrived_output_tokens / load.rate_window_s * share * _with_refused(load)
            per_request = load.arrived_output_tokens / load.arrived_requests * share if load.arrived_requests else 0.0
            # requests arriving much faster than they start decoding pile up upstream while new replicas start
            arriving = load.arrived_requests / load.rate_window_s * _with_refused(load)
            starting = load.started_requests / load.rate_window_s
            piling = (arriving - starting) * self.startup_s if arriving > PILING * starting else 0.0
            coming = (load.upstream + piling) * per_request
            horizon = max(self.slo.ttft_s or 0.0, self.startup_s, 1.0)
            inputs["asked_tokens_per_s"], inputs["coming_tokens"] = asked, coming
            needed = (asked + coming / horizon) * self.u * self.slo.itl_s / capacity
        else:
            needed = seqs / capacity
        if load.kv_usage is not None and load.in_flight:
            decoding_share = min(1.0, load.decoding / load.in_flight)
            inputs["decoding"] = load.decoding
            needed = max(needed, ready * load.kv_usage * decoding_share * seqs / load.in_flight / self.kv_high)
        if self.slo.itl_s and ready:
            terms.append(needed / ready)  # the work asked for and on its way, before the ITL shows it
        return (max(terms) if terms else None), needed, inputs

    def _capacity(self, load: PoolLoad) -> float:
        """Sequences one replica holds within u x the ITL SLO (see the module docstring)."""
        ceiling = float(self.max_num_seqs)
        if not self.slo.itl_s:
            return ceiling * self.u
        target = self.slo.itl_s * self.u
        if load.itl_points:
            self._fit = [FORGET * v for v in self._fit]
            for x, y in load.itl_points:
                for i, v in enumerate((1.0, x, y, x * x, x * y)):
                    self._fit[i] += v
        x, y = load.token_weighted_decoding, load.itl_recent_p50
        n, sx, sy, sxx, sxy = self._fit
        spread = n * sxx - sx * sx
        if n >= 3 and spread > 1e-9 * max(1.0, n * sxx):
            slope = (n * sxy - sx * sy) / spread
            intercept = (sy - slope * sx) / n
            if slope > 1e-9 and intercept < target:
                return max(1.0, min(ceiling, (target - intercept) / slope))
        if y is not None and y > 0 and x > 0:
            return max(1.0, min(ceiling, x * target / y))
        return ceiling * self.u


def _with_refused(load: PoolLoad) -> float:
    """How much more demand there was than the requests admitted show: refused ones are taken to be like them."""
    if not load.refused_requests:
        return 1.0
    return (load.arrived_requests + load.refused_requests) / max(1, load.arrived_requests)
