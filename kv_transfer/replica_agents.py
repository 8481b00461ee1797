"""The KV transfer agents of every rank of one replica, as its driver calls them: one typed method per agent
operation. Each call runs the KVTransferAgent method of the same name on every rank, in that rank's process
(LLMEngine.call_kv_agents sends the unbound method, which pickles by its qualified name), and returns the
ranks' answers by rank. Called on the engine thread only (the connectors and the replica shell), between steps.

Raises what LLMEngine.call_kv_agents raises: ValueError for an engine built without agents, ReplicaFailedError if
a rank is gone, and the agent's own exception if a rank's agent raises.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np

from tandem.engine.core.llm_engine import LLMEngine
from tandem.kv_transfer.agent import AgentStats, KVTransferAgent
from tandem.kv_transfer.descriptor import RankStatus, TransferDescriptor

T = TypeVar("T")


class ReplicaAgents:
    def __init__(self, engine: LLMEngine):
        """engine must have been built with kv_agent=AgentFactory(...)."""
        if not engine.has_kv_agents:
            raise ValueError("this engine was built without a KV transfer agent (LLMEngine(kv_agent=...))")
        self.engine = engine
        self.ranks = range(engine.layout.world_size)

    def _on_every_rank(self, method: Callable[..., T], *args) -> dict[int, T]:
        return self.engine.call_kv_agents(method, {rank: args for rank in self.ranks})

    def listen_addresses(self) -> tuple[str, ...]:
        """Each rank's UCX listener address, in rank order (what a descriptor carries)."""
        found = self._on_every_rank(KVTransferAgent.listen_address)
        return tuple(found[rank] for rank in self.ranks)

    def shared_memory_domains(self) -> tuple[str, ...]:
        """Each rank's shared-memory domain, in rank order ("": none; what a descriptor carries beside the
        addresses, kv_transfer/shm.py)."""
        found = self._on_every_rank(KVTransferAgent.shared_memory_domain)
        return tuple(found[rank] for rank in self.ranks)

    def shares_kv_store(self) -> bool:
        """Whether any rank's KV store is read by same-host receivers directly (KVTransferAgent.shares_kv_store)."""
        return any(self._on_every_rank(KVTransferAgent.shares_kv_store).values())

    def store_reads_pending(self, transfer_ids: Sequence[str]) -> set[str]:
        """Those of transfer_ids whose refs into some rank's KV store a receiver may still read
        (KVTransferAgent.store_reads_pending, on every rank)."""
        return set().union(*self._on_every_rank(KVTransferAgent.store_reads_pending, list(transfer_ids)).values())

    def expect(self, transfer_id: str, block_ids: Sequence[int], deadline: float,
               senders: Sequence[str] = ()) -> None:
        """Decode side: every rank accepts data for transfer_id into block_ids until deadline (time.time()),
        and tells the sending replica's ranks at senders (their agent addresses by rank; empty: nobody) how
        it went."""
        self._on_every_rank(KVTransferAgent.expect, transfer_id, tuple(block_ids), deadline, tuple(senders))

    def arm(self, descriptor: TransferDescriptor, seq_id: str) -> None:
        """Prefill side: every rank pushes seq_id's KV into descriptor as its layers are computed."""
        self._on_every_rank(KVTransferAgent.arm, descriptor, seq_id)

    def send_all(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Sending side, KV already computed: every rank sends its share of block_ids (in token order) into the
        armed transfer now."""
        self._on_every_rank(KVTransferAgent.send_all, transfer_id, tuple(block_ids))

    def poll(self, transfer_ids: Sequence[str]) -> dict[int, dict[str, RankStatus]]:
        """Each rank's status of each transfer it still holds (an id a rank forgot is missing from its dict)."""
        return self._on_every_rank(KVTransferAgent.poll, list(transfer_ids))

    def abort(self, transfer_id: str, reason: str = "aborted", expired: bool = False) -> None:
        """Ends the transfer on every rank as ABORTED (EXPIRED when expired); the peers learn it."""
        self._on_every_rank(KVTransferAgent.abort, transfer_id, reason, expired)

    def release(self, transfer_id: str) -> None:
        """Every rank forgets the transfer (aborting it first where it still runs: no more writes after this)."""
        self._on_every_rank(KVTransferAgent.release, transfer_id)

    def drop_connections(self, reason: str) -> int:
        """KVTransferAgent.drop_connections on every rank; the transfers failed, summed."""
        return sum(self._on_every_rank(KVTransferAgent.drop_connections, reason).values())

    def check_integrity(self) -> None:
        """Raises ValueError if any rank's staging bookkeeping is inconsistent."""
        self._on_every_rank(KVTransferAgent.check_integrity)

    def stats(self) -> dict[int, AgentStats]:
        return self._on_every_rank(KVTransferAgent.stats)

    def source_blocks(self, transfer_id: str) -> dict[int, tuple[int, ...]]:
        """The source blocks each rank's armed transfer sends from (tests, debugging)."""
        return self._on_every_rank(KVTransferAgent.source_blocks, transfer_id)

    def read_kv(self, block_ids_by_rank: dict[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """A copy of the named ranks' K/V of their block ids (tests)."""
        return self.engine.call_kv_agents(KVTransferAgent.read_kv,
                                          {rank: (tuple(ids),) for rank, ids in block_ids_by_rank.items()})
