"""What every serving replica (prefill or decode worker) does around its engine: runs it behind an AsyncEngine,
answers readiness and stats calls, and remembers recently aborted request ids so that a call that arrives after
its abort (calls and aborts may race across processes) is refused instead of holding blocks nobody frees."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Callable

from tandem.engine.async_engine import AsyncEngine
from tandem.engine.kv_events import KVEventBatch, KVEventLog, KVSnapshot
from tandem.engine.llm_engine import LLMEngine

ABORT_MEMORY_S = 120.0


def _ray_if_running():
    """The ray module when this process is connected to a Ray cluster, else None."""
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


def node_id() -> str | None:
    """Ray's id of this process's node (None outside Ray)."""
    ray = _ray_if_running()
    return ray.get_runtime_context().get_node_id() if ray else None


def node_address() -> str:
    """The address other nodes reach this process's node at: Ray's node IP inside a Ray worker, else loopback."""
    ray = _ray_if_running()
    return ray.util.get_node_ip_address() if ray else "127.0.0.1"


class RequestAbortedError(RuntimeError):
    """The request was aborted before this call reached the replica."""


class ReplicaServer:
    def __init__(self, name: str, pool: str, engine: LLMEngine, *, tick: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic, events: KVEventLog | None = None):
        """events: the log engine publishes its KV events to (None: the replica answers no kv_events calls)."""
        self.name = name
        self.events = events
        self.pool = pool
        self.engine = engine
        self.server = AsyncEngine(engine, tick=tick)
        self.server.start()
        self.clock = clock
        self._aborted: dict[str, float] = {}

    def mark_aborted(self, request_id: str) -> None:
        now = self.clock()
        self._aborted[request_id] = now
        for rid in [r for r, t in self._aborted.items() if t < now - ABORT_MEMORY_S]:
            del self._aborted[rid]

    def check_not_aborted(self, request_id: str) -> None:
        if request_id in self._aborted:
            raise RequestAbortedError(f"request {request_id!r} was aborted")

    def info(self) -> dict:
        """Static facts the router and the control plane need (JSON-friendly)."""
        engine = self.engine
        return {"name": self.name, "pool": self.pool, "pid": os.getpid(), "node": node_address(), "node_id": node_id(),
                "layout": engine.layout.describe(),
                "world_size": engine.layout.world_size, "max_model_len": engine.max_model_len,
                "block_size": engine.config.block_size, "kv_blocks_total": engine.kv_cache_spec.num_blocks}

    async def stats(self) -> dict:
        """Counters read on the engine thread between steps (exact, at the cost of waiting for a running step);
        a failed engine reports its last counters with state "failed"."""
        s = await self.server.call(lambda engine: engine.stats()) if self.server.alive else self.server.stats()
        return {"name": self.name, "pool": self.pool, "state": "ready" if self.server.alive else "failed",
                "running": s.num_running, "waiting": s.num_waiting, "waiting_for_kv": s.num_waiting_for_kv,
                "kv_blocks_total": s.num_blocks_total, "kv_blocks_in_use": s.num_blocks_in_use,
                "kv_blocks_cached": s.num_blocks_cached, "kv_usage": s.kv_usage, "prefix_hit_rate": s.prefix_hit_rate,
                "num_preemptions": s.num_preemptions, "num_steps": s.num_steps}

    async def kv_events(self, epoch: str | None, since: int) -> dict:
        """What the router's index needs from this replica, polled: the KV events from `since` on in the log of
        `epoch` (or a snapshot of the prefix cache when those are gone or the epoch is not the log's, e.g. after a
        restart; epoch None asks for one) and the free KV blocks after the engine's last step. Returns {"events":
        KVEventBatch | KVSnapshot, "load": {"kv_blocks_free": int}}."""
        if self.events is None:
            raise ValueError(f"replica {self.name} publishes no KV events")
        batch: KVEventBatch | KVSnapshot | None = self.events.read(epoch, since)
        if batch is None:
            log = self.events
            batch = await self.server.call(lambda engine: KVSnapshot(log.epoch, log.next_seq,
                                                                     engine.cached_block_hashes()))
        s = self.server.stats()
        return {"events": batch, "load": {"kv_blocks_free": s.num_blocks_total - s.num_blocks_in_use}}

    async def check_integrity(self) -> None:
        """Raises ValueError if the replica's KV bookkeeping, or any rank's KV transfer agent, is inconsistent
        (runs on the engine thread)."""
        def check(engine: LLMEngine) -> None:
            engine.check_integrity()
            if engine.has_kv_agents:
                engine.call_kv_agents("check_integrity", {r: () for r in range(engine.layout.world_size)})

        await self.server.call(check)

    async def shutdown(self) -> None:
        await self.server.stop()
        await asyncio.to_thread(self.engine.shutdown)
