"""Builds a rank's transfer agent beside its KV store: LLMEngine(kv_agent=AgentFactory(config)) calls it in
every rank's process (so it must pickle: it holds only the config, and for the in-process fake transport a
Fabric, which only works when every agent lives in one process)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tandem.engine.kv.kv_cache import PagedKVCache
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.kv_transfer.agent import KVTransferAgent
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.shm import SharedSegment, domain

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentFactory:
    """share_kv_store: each rank's CPU KV store lives in shared memory, so same-host receivers copy a request's KV
    straight out of it (one copy; kv_transfer/shm.py). Whoever frees its blocks must then keep them until the
    receivers have read them: PrefillConnector holds them (LLMEngine.hold_blocks_after) until the transfer's ACK
    or, when it ends otherwise, until the receivers answer (KVTransferAgent.store_reads_pending) or their lease is
    over."""

    config: TransferConfig = TransferConfig()
    fabric: object = None  # a fake_transport.Fabric when config.transport == "fake"
    share_kv_store: bool = False

    def __post_init__(self) -> None:
        if self.config.transport == "fake" and self.fabric is None:
            raise ValueError("the fake transport needs a Fabric shared by the agents (AgentFactory(fabric=...))")

    def store_memory(self, device) -> Callable[[int], tuple[np.ndarray, SharedSegment]] | None:
        """Where a rank's KV store on `device` lives (engine/kv/kv_cache.py's store_memory_of): a shared segment
        where share_kv_store and the same-host path can be on there, else None (private memory)."""
        if not (self.share_kv_store and self.config.shared_memory and device.type == "cpu" and domain()):
            return None

        def shared(nbytes: int) -> tuple[np.ndarray, SharedSegment | None]:
            try:
                segment = SharedSegment(nbytes)
            except OSError as e:
                _log.warning("the KV store stays in private memory (cannot make a memfd: %s)", e)
                return np.zeros(nbytes, dtype=np.uint8), None
            return segment.buffer, segment

        return shared

    def __call__(self, rank: int, layout: ReplicaLayout, kv_cache: PagedKVCache) -> KVTransferAgent:
        if self.config.transport == "fake":
            from tandem.kv_transfer.fake_transport import FakeTransport

            transport = FakeTransport(self.fabric)
        else:
            from tandem.kv_transfer.ucx_transport import UCXTransport

            port = self.config.port + rank if self.config.port else 0  # one listener per rank
            device = kv_cache.data.device
            transport = UCXTransport(self.config.host, port, self.config.ucx_env,
                                     cuda_device=device.index if device.type == "cuda" else None)
        return KVTransferAgent(kv_cache, layout, rank, transport, self.config)
