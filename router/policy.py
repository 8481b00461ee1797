"""Which replica of a pool gets the next request: plain Python over the router's own counters and the prefix
index's overlaps (no Ray, no gRPC).

Policies:
  - cache_aware (default). Prefill replicas by estimated prefill work ahead of this request's first token, in
    tokens: w_queue * queued prefill tokens + w_running * requests in flight - w_prefix * cached-prefix tokens
    (lowest first). Decode replicas by w_free * free KV blocks - w_running * sequences in flight (highest
    first).
  - least_loaded: fewest requests in flight (ties keep the pool's order).
  - round_robin, random: the baselines cache_aware is compared with.
Under every policy a replica that refused room recently is tried last: until it accepts a request, or the KV
feed sees its free blocks grow (kv_feed.py), whichever comes first (else a replica that refused once while
others had room would never be tried first again).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

from tandem.engine.core.kv_tiers import PRIOR_HIT_COSTS, TierHitCosts

POLICIES = ("cache_aware", "least_loaded", "round_robin", "random")


@dataclass
class ReplicaLoad:
    """The router's view of one replica. in_flight: requests the router sent there and has not seen finish.
    queued_prefill_tokens: uncached prompt tokens of prefills sent there and not answered yet (router's own
    count). kv_blocks_free: the replica's last polled count (None: not polled yet). refusals:
    reservations it refused since its last success (then it is tried last). tier_hit_costs: what a prefix block
    on its host or disk KV tier costs to copy up, against recomputing it (its last polled measurement).
    prefill_tokens_per_s: its measured prefill speed (None: not measured yet)."""

    name: str
    in_flight: int = 0
    refusals: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_free: int | None = None
    tier_hit_costs: TierHitCosts = PRIOR_HIT_COSTS
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class RoutingWeights:
    """cache_aware's weights (manifest router.weights). Prefill costs are in tokens: prefix_tokens is what one
    cached prompt token saves, queued_prefill_tokens what one queued token costs (less than a computed token by
    default: a replica prefills its queue in batches, and a prefix computed twice costs every later request
    too), prefill_in_flight what one request in flight costs. Decode scores are in KV blocks: free_blocks per
    free block, decode_in_flight per sequence in flight."""

    prefix_tokens: float = 1.0
    queued_prefill_tokens: float = 0.5
    prefill_in_flight: float = 8.0
    free_blocks: float = 1.0
    decode_in_flight: float = 16.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:
                raise ValueError(f"routing weight {name} must be >= 0, got {value!r}")


@dataclass
class ReplicaPicker:
    """Ranks one pool's replicas. One picker per pool (round_robin's turn is per picker)."""

    policy: str = "cache_aware"
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    rng: random.Random = field(default_factory=random.Random)
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")

    def rank_prefill(self, replicas: Sequence[ReplicaLoad], overlap: Mapping[str, float], *, block_size: int,
                     cached_blocks: Callable[[str], int] = lambda name: 0) -> Iterator[ReplicaLoad]:
        """Prefill replicas best first. overlap: cached-prefix blocks per replica name (absent: none), a block on
        a lower KV tier counted as the fraction of a recomputed block it saves (Routing weighs them).
        cached_blocks: blocks a replica caches in all; among equal costs the emptiest cache goes first, so that
        on an idle pool new prefixes spread out instead of piling onto the first replica."""
        if self.policy != "cache_aware":
            return self._baseline(replicas)
        w = self.weights
        q, f, p = w.queued_prefill_tokens, w.prefill_in_flight, w.prefix_tokens * block_size
        get = overlap.get
        # One flat list comprehension: this runs over every replica of the pool for every request.
        costs = [q * r.queued_prefill_tokens + f * r.in_flight - p * get(r.name, 0) + (REFUSED if r.refusals else 0.0)
                 for r in replicas]
        return _best_first(replicas, costs, lambda i: cached_blocks(replicas[i].name))

    def rank_decode(self, replicas: Sequence[ReplicaLoad]) -> Iterator[ReplicaLoad]:
        """Decode replicas best first."""
        if self.policy != "cache_aware":
            return self._baseline(replicas)
        w = self.weights
        d, b = w.decode_in_flight, w.free_blocks
        costs = [d * r.in_flight - b * (r.kv_blocks_free or 0) + (REFUSED if r.refusals else 0.0) for r in replicas]
        return _best_first(replicas, costs)

    def _baseline(self, replicas: Sequence[ReplicaLoad]) -> Iterator[ReplicaLoad]:
        if not replicas:
            return iter(())
        if self.policy == "least_loaded":
            return _best_first(replicas, [r.in_flight + (REFUSED if r.refusals else 0.0) for r in replicas])
        if self.policy == "random":
            ranked = list(replicas)
            self.rng.shuffle(ranked)
        else:  # round_robin
            start = next(self._turn) % len(replicas)
            ranked = list(replicas[start:]) + list(replicas[:start])
        return iter(sorted(ranked, key=lambda r: r.refusals > 0))


REFUSED = 1e18  # added to the cost of a replica that refused room recently: it goes last


def _best_first(items: Sequence[ReplicaLoad], costs: list[float],
                tiebreak: Callable[[int], int] | None = None) -> Iterator[ReplicaLoad]:
    """items by cost, ties in input order (or by tiebreak(index), lowest first). Finding the first costs one
    pass; the rest are sorted only when the caller asks for a second (the first usually takes the request)."""
    if not items:
        return
    low = min(costs)
    best = costs.index(low)
    if tiebreak is not None and costs.count(low) > 1:
        best = min((i for i, c in enumerate(costs) if c == low), key=tiebreak)
    yield items[best]
    yield from (items[i] for i in sorted(range(len(costs)), key=costs.__getitem__) if i != best)
