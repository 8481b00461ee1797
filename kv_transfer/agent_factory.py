"""Builds a rank's transfer agent beside its KV store: LLMEngine(kv_agent=AgentFactory(config)) calls it in
every rank's process (so it must pickle: it holds only the config, and for the in-process fake transport a
Fabric, which only works when every agent lives in one process)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.kv_cache import PagedKVCache
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.kv_transfer.agent import KVTransferAgent
from tandem.kv_transfer.config import TransferConfig


@dataclass(frozen=True)
class AgentFactory:
    config: TransferConfig = TransferConfig()
    fabric: object = None  # a fake_transport.Fabric when config.transport == "fake"

    def __post_init__(self) -> None:
        if self.config.transport == "fake" and self.fabric is None:
            raise ValueError("the fake transport needs a Fabric shared by the agents (AgentFactory(fabric=...))")

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
