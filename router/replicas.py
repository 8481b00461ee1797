"""The replicas the router routes to: each as the router sees it (Replica: the contract it answers, its static
info, the router's load counters for it), the two pools as one registry (ReplicaPools), and what counts as a
replica's death. The request driver (lifecycle.py) and the KV feed (kv_feed.py) both read these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from tandem.engine.errors import EngineDeadError, ReplicaFailedError
from tandem.replica.contract import DecodeReplicaAPI, PrefillReplicaAPI, ReplicaInfo
from tandem.router.lora_routes import LoRARoutes
from tandem.router.policy import ReplicaLoad

API = TypeVar("API", PrefillReplicaAPI, DecodeReplicaAPI)


class NoCapacityError(RuntimeError):
    """No replica had room within the queue's limits (gRPC RESOURCE_EXHAUSTED)."""


class NoReplicaError(RuntimeError):
    """The pool has no live replica (gRPC UNAVAILABLE)."""


class ReplicaLostError(RuntimeError):
    """A replica serving the request died (gRPC UNAVAILABLE); the router no longer routes to it."""


def is_replica_death(error: BaseException) -> bool:
    """Whether error says the replica can serve no more: its actor is gone (Ray's RayActorError and its
    subclasses), or its engine died under it (a rank process killed mid-step: EngineDeadError or
    ReplicaFailedError, as the replica raised it or wrapped in Ray's RayTaskError)."""
    if isinstance(error, (EngineDeadError, ReplicaFailedError)) or isinstance(
            getattr(error, "cause", None), (EngineDeadError, ReplicaFailedError)):
        return True
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # the driver also runs over mock replicas without Ray
        return False
    return isinstance(error, RayActorError)


@dataclass
class Replica(Generic[API]):
    """A replica as the router sees it: the contract it answers (PrefillReplicaAPI or DecodeReplicaAPI), its
    static info (None: not known, e.g. a test's mock), and the router's load counters for it."""

    name: str
    pool: str
    api: API
    info: ReplicaInfo | None = None
    load: ReplicaLoad = None

    def __post_init__(self) -> None:
        self.load = self.load or ReplicaLoad(self.name)


class ReplicaPools:
    """The prefill and decode replicas routed to, in pool order, by name; and the names of those found dead.
    Mutated only on the router's event loop."""

    def __init__(self, prefill: list[Replica[PrefillReplicaAPI]], decode: list[Replica[DecodeReplicaAPI]]):
        self.prefill = prefill
        self.decode = decode
        self.lost: list[str] = []  # replicas found dead, no longer routed to
        self._by_name = {r.name: r for r in prefill + decode}
        self.adapters = LoRARoutes()  # the LoRA adapters served, and where (lora_routes.py)
        for replica in prefill + decode:
            self.adapters.wrap(replica)

    def all(self) -> list[Replica]:
        return self.prefill + self.decode

    def loads(self, adapter: str | None = None) -> tuple[list[ReplicaLoad], list[ReplicaLoad]]:
        """Each pool's replicas' loads, to route among: with a LoRA adapter, those that serve it already where some
        do (the others load it before they serve the request: lora_routes.py)."""
        def serving(pool: list[Replica]) -> list[ReplicaLoad]:
            holders = self.adapters.holders.get(adapter, ()) if adapter is not None else None
            holding = [r for r in pool if holders is None or r.name in holders]
            return [r.load for r in holding or pool]

        return serving(self.prefill), serving(self.decode)

    def get(self, name: str) -> Replica | None:
        """The replica of that name, None once it left its pool."""
        return self._by_name.get(name)

    def __getitem__(self, name: str) -> Replica:
        return self._by_name[name]

    def add(self, replica: Replica) -> None:
        """Raises ValueError for a name already routed to."""
        if replica.name in self._by_name:
            raise ValueError(f"replica {replica.name} is already routed to")
        self._by_name[replica.name] = replica
        self.adapters.wrap(replica)
        (self.prefill if replica.pool == "prefill" else self.decode).append(replica)

    def remove(self, name: str) -> Replica | None:
        """Takes the replica out of its pool; returns it, or None if no pool held it."""
        replica = self._by_name.pop(name, None)
        self.adapters.forget(name)
        if replica is not None:
            (self.prefill if replica.pool == "prefill" else self.decode).remove(replica)
        return replica
