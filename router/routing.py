"""Routing one request: which decode replicas to try, which prefill replica computes the prompt, or whether the
decode replica prefills it itself (conditional disaggregation), and why. Plain Python: the prefix indexes, the
replicas' load counters and the session table are all the router's own state; nothing here waits on a replica.

The decision for a disaggregated request with n == 1:
  1. hash the prompt's full blocks (with the tenant's cache salt), as the replicas' prefix caches do;
  2. rank the decode pool (policy), the session's last decode replica first while it is not overloaded;
  3. prefill on that decode replica instead of the prefill pool when the prompt's uncached tokens there are
     below `local_prefill_max_tokens` (short_prompt), when every prefill replica has at least
     `prefill_saturation_tokens` queued (prefill_saturated), or when the prefill pool is empty
     (no_prefill_replica);
  4. otherwise rank the prefill pool (policy; cached-prefix overlap against load under cache_aware), the
     session's last prefill replica first while it is not overloaded;
  5. expect the prompt's blocks on the chosen replicas (PrefixIndex.expect), so that the next request sharing
     the prefix finds them before the replicas' events arrive. Ties in cost go to the replica whose cache
     holds the fewest blocks, which spreads new prefixes over an idle pool.
A cached block counts whole when it is on the replica's device, and as 1 - cost when it is only on the replica's
host or disk KV tier, cost being what copying it up takes against recomputing it, as the replica measured
(ReplicaLoad.tier_hit_costs): a host hit is nearly a device hit, a slow disk's may be worth little or nothing.
Colocated mode and n > 1 always prefill on the decode replica (reasons "colocated", "n_gt_1").
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from tandem.engine.core.kv_tiers import PRIOR_HIT_COSTS
from tandem.engine.kv.prefix_cache import block_hashes
from tandem.router.kv_index import PrefixIndex
from tandem.router.policy import ReplicaLoad, ReplicaPicker, RoutingWeights

PREFILL_POOL = "prefill_pool"


@dataclass(frozen=True)
class RoutingSettings:
    """The manifest's router section, as routing needs it. Thresholds are in tokens; 0 turns each off.
    affinity_max_gap: a session's replica is overloaded when it has more than this many requests in flight
    beyond the least busy replica of its pool."""

    policy: str = "cache_aware"
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    local_prefill_max_tokens: int = 0
    prefill_saturation_tokens: int = 0
    session_affinity: bool = False
    affinity_max_gap: int = 4
    pull_min_blocks: int = 4  # prefix pulls (prefix_pulls.py): the least net saving, in blocks, worth one; 0: off
    max_sessions: int = 100_000
    expect_ttl_s: float = 5.0


@dataclass(frozen=True)
class RoutePlan:
    """decode: candidates best first (lazy; try them in turn until one has room). prefill: the prefill replica's
    load record, or None when the decode replica prefills (reason says why). hashes: the prompt's block hashes.
    uncached_tokens: prompt tokens the chosen prefill replica is expected to compute (by the index).
    cached_blocks: its cached prefix as routing weighed it (a block on a lower tier counts less). decision_s:
    what planning cost."""

    decode: Iterator[ReplicaLoad]
    prefill: ReplicaLoad | None
    reason: str
    hashes: tuple[int, ...]
    uncached_tokens: int
    decision_s: float
    cached_blocks: float = 0.0


class Routing:
    def __init__(self, settings: RoutingSettings, block_size: int, *, clock=time.monotonic):
        """observe (settable): called with each decision's cost in seconds (the router's metrics)."""
        self.observe: Callable[[float], None] = lambda seconds: None
        self.settings = settings
        self.block_size = block_size
        self.clock = clock
        self.pickers = {pool: ReplicaPicker(settings.policy, settings.weights) for pool in ("prefill", "decode")}
        self.indexes = {pool: PrefixIndex(ttl_s=settings.expect_ttl_s, clock=clock) for pool in ("prefill", "decode")}
        self.sessions: OrderedDict[str, tuple[str | None, str]] = OrderedDict()  # id -> (prefill, decode) names
        self.decisions: Counter[tuple[str, str]] = Counter()  # (where, reason) -> count

    def plan(self, prompt: Sequence[int], *, prefill: Sequence[ReplicaLoad], decode: Sequence[ReplicaLoad],
             local_reason: str | None = None, cache_salt: str | None = None, session: str = "") -> RoutePlan:
        """The route of one request (see the module docstring). local_reason: the caller already knows the
        decode replica prefills ("colocated", "n_gt_1"). Does not count the decision; record() does, once the
        request has a replica."""
        start = time.perf_counter()
        hashes = tuple(block_hashes(prompt, self.block_size, cache_salt))
        last = self.sessions.get(session) if session and self.settings.session_affinity else None
        decode_order = self.pickers["decode"].rank_decode(decode)
        if last is not None:
            decode_order = self._sticky(last[1], decode, decode_order)
        reason, chosen = local_reason, None
        uncached, cached = len(prompt), 0.0
        if reason is None:
            reason = self._local_reason(prompt, hashes, prefill, decode)
        if reason is None:
            index = self.indexes["prefill"]
            overlap = index.overlap(hashes)
            weighed = weigh_tiers(index, overlap, hashes, prefill)
            prefill_order = self.pickers["prefill"].rank_prefill(prefill, weighed, block_size=self.block_size,
                                                                 cached_blocks=index.num_blocks)
            if last is not None and last[0] is not None:
                prefill_order = self._sticky(last[0], prefill, prefill_order)
            chosen = next(prefill_order)
            uncached = len(prompt) - min(len(prompt) - 1, overlap.get(chosen.name, 0) * self.block_size)
            cached = weighed.get(chosen.name, 0.0)
            reason = PREFILL_POOL
            # Expected there from now on, so that requests sharing the prefix that arrive before the replica's
            # events (a burst) follow this one.
            index.expect(chosen.name, hashes)
        elapsed = time.perf_counter() - start
        self.observe(elapsed)
        return RoutePlan(decode_order, chosen, reason, hashes, uncached, elapsed, cached)

    def _local_reason(self, prompt: Sequence[int], hashes: tuple[int, ...], prefill: Sequence[ReplicaLoad],
                      decode: Sequence[ReplicaLoad]) -> str | None:
        s = self.settings
        if not prefill:
            return "no_prefill_replica"
        if s.local_prefill_max_tokens and decode:
            index = self.indexes["decode"]
            best = max(weigh_tiers(index, index.overlap(hashes), hashes, decode).values(), default=0) * self.block_size
            if len(prompt) - best < s.local_prefill_max_tokens:
                return "short_prompt"
        if s.prefill_saturation_tokens and min(r.queued_prefill_tokens for r in prefill) >= s.prefill_saturation_tokens:
            return "prefill_saturated"
        return None

    def _sticky(self, name: str, pool: Sequence[ReplicaLoad], order: Iterator[ReplicaLoad]) -> Iterator[ReplicaLoad]:
        """order with the session's replica moved first, unless it left the pool or is overloaded."""
        preferred = next((r for r in pool if r.name == name), None)
        if preferred is None or preferred.refusals or \
                preferred.in_flight > min(r.in_flight for r in pool) + self.settings.affinity_max_gap:
            return order
        return _first_then(preferred, order)

    def record(self, plan: RoutePlan, *, prefill: str | None, decode: str, session: str = "") -> None:
        """Counts the decision, expects the prompt's blocks on the decode replica (transferred or computed there,
        they are cached there; plan() expected them on the prefill replica already), and remembers the
        session's replicas."""
        self.count("prefill_pool" if prefill is not None else "decode_replica", plan.reason)
        self.indexes["decode"].expect(decode, plan.hashes)  # transferred or computed there, it is cached there
        if session and self.settings.session_affinity:
            self.sessions[session] = (prefill, decode)
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.settings.max_sessions:
                self.sessions.popitem(last=False)

    def count(self, where: str, reason: str) -> None:
        """One prompt prefilled `where` ("prefill_pool" | "decode_replica") for `reason`."""
        self.decisions[(where, reason)] += 1

    def forget_replica(self, pool: str, name: str) -> None:
        """The replica left its pool: drop it from the index (sessions skip it on their own)."""
        self.indexes[pool].remove_replica(name)


def weigh_tiers(index: PrefixIndex, overlap: dict[str, int], hashes: Sequence[int],
                pool: Sequence[ReplicaLoad]) -> dict[str, float]:
    """overlap (matched blocks per replica) with each block found only on a replica's host or disk tier counted
    as the share of recomputing it that copying it up saves (1 - its tier's hit cost; less than 0 when the copy
    costs more). Replicas without tiers keep their whole count."""
    weighed: dict[str, float] = dict(overlap)
    loads = None
    for name, depth in overlap.items():
        if not index.num_lower_blocks(name):
            continue
        host, disk = index.lower_tier_blocks(name, hashes[:depth])
        if host or disk:
            loads = loads or {r.name: r for r in pool}
            load = loads.get(name)
            costs = load.tier_hit_costs if load is not None else PRIOR_HIT_COSTS
            weighed[name] = depth - host * costs.host - disk * costs.disk
    return weighed


def _first_then(first: ReplicaLoad, rest: Iterator[ReplicaLoad]) -> Iterator[ReplicaLoad]:
    yield first
    yield from (r for r in rest if r is not first)
