"""Shared pieces of the KV transfer tests: replicas of agents over random KV, transports by name, waiting."""

from __future__ import annotations

import socket
import time
from typing import Callable

import torch

from tandem.engine.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout
from tandem.kv_transfer.agent import KVTransferAgent
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat, TransferDescriptor
from tandem.kv_transfer.fake_transport import Fabric, FakeTransport

TRANSPORTS = ["fake", "ucx"]


def make_transport(kind: str, fabric: Fabric):
    if kind == "fake":
        return FakeTransport(fabric)
    from tandem.kv_transfer.ucx_transport import UCXTransport

    return UCXTransport("127.0.0.1", 0, TransferConfig().ucx_env)


def nowhere(kind: str) -> str:
    """An address nothing listens at (connections to it are refused)."""
    if kind == "fake":
        return "fake:0"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


class AgentReplica:
    """One agent per rank of `layout`, each over its own share of a random global KV tensor
    [layers, 2, blocks, KV heads, block_size, head_dim] (`whole`), as a replica's ranks hold it."""

    def __init__(self, layout: ReplicaLayout, *, num_blocks: int, block_size: int, head_dim: int, kind: str,
                 fabric: Fabric, config: TransferConfig = TransferConfig(), seed: int = 0,
                 transport_wrapper=None, clock=time.time):
        gen = torch.Generator().manual_seed(seed)
        self.layout = layout
        self.whole = torch.randn(layout.num_layers, 2, num_blocks, layout.num_kv_heads, block_size, head_dim,
                                 generator=gen)
        self.agents: list[KVTransferAgent] = []
        for rank in range(layout.world_size):
            shard = layout.shard(rank)
            cache = PagedKVCache(KVCacheSpec(len(shard.layers), num_blocks, block_size, len(shard.kv_heads),
                                             head_dim, torch.float32))
            cache.data.copy_(self.whole[shard.layers.start:shard.layers.stop, :, :,
                                        shard.kv_heads.start:shard.kv_heads.stop])
            transport = make_transport(kind, fabric)
            if transport_wrapper is not None:
                transport = transport_wrapper(transport)
            self.agents.append(KVTransferAgent(cache, layout, rank, transport, config, clock=clock))
        self.format = KVFormat(layout.num_layers, layout.num_kv_heads, head_dim, block_size, "float32")

    def descriptor(self, transfer_id: str, block_ids, num_tokens: int, lease_s: float = 30.0) -> TransferDescriptor:
        deadline = time.time() + lease_s
        for agent in self.agents:
            agent.expect(transfer_id, block_ids, deadline)
        return TransferDescriptor(transfer_id, self.layout, tuple(a.address for a in self.agents), tuple(block_ids),
                                  num_tokens, self.format, deadline)

    def holds(self, block_ids, expected: torch.Tensor) -> bool:
        """Every rank's share of block_ids equals its slice of `expected` ([layers, 2, blocks, heads, ...])."""
        rows = torch.tensor(list(block_ids))
        for rank, agent in enumerate(self.agents):
            shard = self.layout.shard(rank)
            mine = agent.kv.data.index_select(2, rows)
            want = expected[shard.layers.start:shard.layers.stop, :, :, shard.kv_heads.start:shard.kv_heads.stop]
            if not torch.equal(mine, want):
                return False
        return True

    def states(self, transfer_id: str) -> list:
        return [agent.poll([transfer_id]).get(transfer_id) for agent in self.agents]

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


def layout_of(parallel: ParallelConfig, *, num_layers: int, num_heads: int, num_kv_heads: int,
              num_experts: int = 0) -> ReplicaLayout:
    return ReplicaLayout.build(parallel, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               num_experts=num_experts)
