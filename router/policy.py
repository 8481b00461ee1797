"""Which replica of a pool gets the next request: plain Python over the router's own counters (no Ray, no
gRPC). Cache-aware scoring arrives with the router issue; these are the baselines it is compared with."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class ReplicaLoad:
    """The router's view of one replica: requests it sent there and has not seen finish, and whether the
    replica refused room recently (then it is tried last)."""

    name: str
    in_flight: int = 0
    refusals: int = 0


@dataclass
class ReplicaPicker:
    """policy: "least_loaded" (fewest requests in flight; ties keep the pool's order), "round_robin" or "random".
    One picker serves one pool (round_robin's turn is per picker)."""

    policy: str = "least_loaded"
    rng: random.Random = field(default_factory=random.Random)
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.policy not in ("least_loaded", "round_robin", "random"):
            raise ValueError(f"unknown routing policy {self.policy!r}")

    def order(self, replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
        """Every replica, best first: the router tries them in this order until one has room."""
        if not replicas:
            return []
        if self.policy == "random":
            ranked = list(replicas)
            self.rng.shuffle(ranked)
        elif self.policy == "round_robin":
            start = next(self._turn) % len(replicas)
            ranked = list(replicas[start:]) + list(replicas[:start])
        else:
            ranked = sorted(replicas, key=lambda r: r.in_flight)
        return sorted(ranked, key=lambda r: r.refusals > 0)  # stable: keeps the policy's order otherwise
