"""What every serving replica (prefill or decode worker) is around its engine: it builds the engine from its
ReplicaSpec with a KV transfer agent on every rank, plugs its role's connector into the engine thread, runs the
engine behind an AsyncEngine, and answers the calls every replica answers (contract.py's ReplicaAPI: ready, stats,
kv_events, abort, check_integrity, shutdown); ready() reports its KV agents' addresses, and stats() the messages
they dropped. A replica with KV agents also sends and receives prefix pulls (reserve_prefix, send_prefix,
keep_prefix: router/prefix_pulls.py), whatever its role, with a connector of each kind. It remembers recently
aborted request ids, so that a call arriving after its abort (calls and aborts may race across processes) is refused
instead of holding blocks nobody frees. The role's own calls live in prefill_worker/replica.py and
decode_worker/replica.py.

This module and the two role modules import the runtime (torch, the engine, the KV agents) only when a replica is
built: every process that receives a replica's Ray handle imports its actor class's module (Ray reads the class's
methods from it), the router's process included, and the router stays torch-free (tests/replica/test_contract.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, ClassVar, Sequence

from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.decoding.speculation import SpeculationStats
from tandem.engine.heap import settle
from tandem.engine.kv.kv_events import DISK, HOST, KVEventBatch, KVEventLog, KVSnapshot
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferFailedError, TransferState
from tandem.kv_transfer.drops import MessageDrops
from tandem.replica.contract import KVEventsReply, ReplicaInfo, ReplicaStats, RequestAbortedError, StreamCall
from tandem.replica.spec import ReplicaSpec
from tandem.replica.token_channel import ChannelEnd, ChannelEndpoint, ChannelServer
from tandem.replica.tracing import UNTRACED, CallTrace, ReplicaTracer, TracingConfig, Untraced

if TYPE_CHECKING:
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.kv_transfer.connector import DecodeConnector, PrefillConnector, TransferEvent
    from tandem.kv_transfer.connector_loop import ConnectorLoop

ABORT_MEMORY_S = 120.0
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCounts:
    """What a replica's KV agents counted, summed over its ranks: messages dropped by reason, DATA messages sent by
    reference, KV payload bytes sent and received."""

    drops: MessageDrops = MessageDrops()
    by_reference: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


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


Connect = Callable[["LLMEngine", TransferConfig], "PrefillConnector | DecodeConnector"]


class ReplicaShell:
    """The base of the prefill and decode replica actors: a subclass names its pool and passes how its role's
    connector is built."""

    pool: ClassVar[str]
    streams: ClassVar[tuple[type, ...]] = ()  # the stream calls (replica/contract.py StreamCall) it answers

    def __init__(self, name: str, spec: ReplicaSpec, transfer: TransferConfig | None, connect: Connect, *,
                 clock: Callable[[], float] = time.monotonic, settle_heap: bool = False,
                 tracing: TracingConfig | None = None):
        """transfer None: no KV agents and no connector (a colocated decode replica). transfer.host "": this
        node's address. connect(engine, transfer): the role's connector, built once before the engine thread
        starts. tracing: write spans of the calls the router traces (replica/tracing.py; None or no endpoint: no
        tracer). settle_heap: this process serves until it ends (a replica actor the control plane started): once
        built, freeze what it holds so that garbage collections, which pause the engine's step loop, stop scanning
        it (engine/heap.py). Raises ModelLoadError / ValueError / ReplicaFailedError if the engine cannot
        start."""
        from tandem.engine.core.async_engine import AsyncEngine
        from tandem.kv_transfer.agent_factory import AgentFactory
        from tandem.kv_transfer.connector_loop import ConnectorLoop

        if transfer is not None and not transfer.host:
            transfer = transfer.on_host(node_address())
        self.name = name
        self.clock = clock
        self.events = KVEventLog()
        # A prefill replica's KV store is shared with same-host decode replicas, which read it directly.
        agents = AgentFactory(transfer, share_kv_store=self.pool == "prefill") if transfer is not None else None
        self.engine = spec.build(kv_agent=agents,
                                 event_sink=self.events)
        self.connector = connect(self.engine, transfer) if transfer is not None else None
        self.transfers = ConnectorLoop(self.connector, on_failed=self._transfer_failed) if self.connector else None
        self._receiving = self._sending = None  # prefix pulls in and out: the role's own loop, or one of the other kind
        if self.connector is not None:
            from tandem.kv_transfer.connector import DecodeConnector, PrefillConnector

            self._receiving = self.transfers if isinstance(self.connector, DecodeConnector) else \
                ConnectorLoop(DecodeConnector(self.engine, transfer))
            self._sending = self.transfers if isinstance(self.connector, PrefillConnector) else \
                ConnectorLoop(PrefillConnector(self.engine))
        self._loops = [loop for loop in dict.fromkeys((self.transfers, self._receiving, self._sending)) if loop]
        self.server = AsyncEngine(self.engine, tick=self._tick if self._loops else None)
        self.server.start()
        self._aborted: dict[str, float] = {}
        # the agents' counters as last read (what a failed engine reports)
        self._kv_counts = KVCounts()
        self._speculation: SpeculationStats | None = None  # as of the last stats() (a failed engine keeps them)
        self._channel = ChannelServer()
        self.tracer = ReplicaTracer(tracing, name, self.pool) if tracing is not None and tracing.otlp_endpoint else None
        if settle_heap:
            _log.info("replica %s: %d objects frozen at its start", name, settle())

    def _transfer_failed(self, event: TransferEvent) -> None:
        """Engine thread: a transfer ended badly (the connector already freed its blocks). Default: nothing."""

    def _tick(self) -> bool:
        """Engine thread: polls every connector; True while any has transfers pending."""
        return any([loop.tick() for loop in self._loops])

    # -- what every replica answers (contract.ReplicaAPI) ----------------------------------------------------

    async def ready(self) -> ReplicaInfo:
        from tandem.engine.kv.kv_cache import kv_dtype_name  # torch: only where a replica is built

        engine = self.engine
        return ReplicaInfo(name=self.name, pool=self.pool, pid=os.getpid(), node=node_address(), node_id=node_id(),
                           layout=tuple(engine.layout.describe()), world_size=engine.layout.world_size,
                           max_model_len=engine.max_model_len, block_size=engine.config.block_size,
                           kv_blocks_total=engine.kv_cache_spec.num_blocks,
                           kv_addresses=self.connector.addresses if self.connector else (),
                           device=f"{engine.loaded.device.type} {str(engine.loaded.dtype).removeprefix('torch.')}",
                           ranks=engine.rank_placements, weights=engine.loaded.weight_format,
                           kv_dtype=kv_dtype_name(engine.kv_dtype), lora_adapters=engine.lora.names)

    async def stats(self) -> ReplicaStats:
        """Counters read on the engine thread between steps (exact, at the cost of waiting for a running step),
        with every rank's KV agent's dropped messages and messages sent by reference summed; a failed engine
        reports its last counters with state "failed"."""
        if self.server.alive:
            s, self._kv_counts, self._speculation = await self.server.call(
                lambda engine: (engine.stats(), self._read_kv_counts(), engine.speculation_stats()))
        else:
            s = self.server.stats()
        return ReplicaStats(name=self.name, pool=self.pool, state="ready" if self.server.alive else "failed",
                            running=s.num_running, waiting=s.num_waiting, waiting_for_kv=s.num_waiting_for_kv,
                            kv_blocks_total=s.num_blocks_total, kv_blocks_in_use=s.num_blocks_in_use,
                            kv_blocks_cached=s.num_blocks_cached, kv_usage=s.kv_usage,
                            prefix_hit_rate=s.prefix_hit_rate, num_preemptions=s.num_preemptions,
                            num_steps=s.num_steps, kv_messages_dropped=self._kv_counts.drops,
                            kv_messages_by_reference=self._kv_counts.by_reference,
                            kv_bytes_sent=self._kv_counts.bytes_sent,
                            kv_bytes_received=self._kv_counts.bytes_received,
                            stream_frames=self._channel.frames_sent,
                            ranks_alive=tuple(self.engine.ranks_alive()), speculation=self._speculation,
                            kv_tiers=s.tiers, kv_tier_hit_costs=s.tier_hit_costs)

    async def health(self) -> str | None:
        """None while the engine runs and every rank process lives; else why not (read without waiting for the
        engine thread: a long step is not a failure)."""
        if not self.server.alive:
            return f"its engine failed: {self.server.error!r}" if self.server.error else "its engine stopped"
        dead = self.engine.dead_ranks()
        return f"{', '.join(dead)} died" if dead else None

    def _read_kv_counts(self) -> KVCounts:
        """Engine thread: the ranks' agents' counters, summed (zeros without agents)."""
        if self.connector is None:
            return KVCounts()
        ranks = self.connector.agents.stats().values()
        return KVCounts(sum((s.drops for s in ranks), MessageDrops()), sum(s.by_reference for s in ranks),
                        sum(s.bytes_sent for s in ranks), sum(s.bytes_received for s in ranks))

    async def kv_events(self, epoch: str | None, since: int) -> KVEventsReply:
        """The KV events from `since` on in the log of `epoch`, or a snapshot of the prefix cache and the KV
        tiers (taken on the engine thread) when those are gone or the epoch is not the log's (a restart; epoch
        None asks for one), the free KV blocks after the engine's last step and what a hit on each tier costs."""
        batch: KVEventBatch | KVSnapshot | None = self.events.read(epoch, since)
        if batch is None:
            log = self.events
            batch = await self.server.call(lambda engine: KVSnapshot(
                log.epoch, log.next_seq, engine.cached_block_hashes(), engine.cached_block_hashes(HOST),
                engine.cached_block_hashes(DISK)))
        s = self.server.stats()
        return KVEventsReply(batch, s.num_blocks_total - s.num_blocks_in_use, s.tier_hit_costs,
                             s.prefill_tokens_per_s)

    async def abort(self, request_id: str) -> None:
        """Ends the request wherever it is here (reserved, transferring, computing, decoding) and frees its
        blocks; a later call for the same id is refused. Unknown ids are remembered, not an error."""
        self._mark_aborted(request_id)
        if self._loops:
            await self.server.call(lambda _e: [loop.forget(request_id) for loop in self._loops])
        await self.server.abort(request_id)

    # -- prefix pulls (router/prefix_pulls.py) --------------------------------------------------------------

    async def reserve_prefix(self, pull_id: str, prefix_token_ids: Sequence[int], *, cache_salt: str | None = None,
                             senders: tuple[str, ...] = ()) -> TransferDescriptor | None:
        """Holds blocks for a prefix of whole blocks another replica sends (senders: its agents' addresses):
        the descriptor covers the prefix's last blocks, those not cached here yet. None when there is no room
        now. Raises ValueError on a replica without KV agents."""
        receiving = self._pull_loop(self._receiving)
        self._check_not_aborted(pull_id)
        return await self.server.call(lambda _e: receiving.connector.reserve_prefix(
            pull_id, prefix_token_ids, cache_salt=cache_salt, senders=senders))

    async def send_prefix(self, pull_id: str, block_hashes: tuple[int, ...], descriptor: TransferDescriptor, *,
                          prefix_token_ids: tuple[int, ...] = (), cache_salt: str | None = None) -> None:
        """Sends this replica's cached blocks of block_hashes into descriptor; returns once every destination
        rank acknowledged them. prefix_token_ids (the prefix up to the last of them): blocks on this replica's
        KV tiers only are first brought up by running it as a one-token request (the tiers serve what they
        hold). Raises LookupError if it does not cache them all, TransferFailedError if the transfer ended
        otherwise."""
        sending = self._pull_loop(self._sending)
        self._check_not_aborted(pull_id)
        if prefix_token_ids and await self.server.call(lambda e: e.cached_run(block_hashes)) < len(block_hashes):
            rid = f"{pull_id}/up"
            stream = self.server.add_request(rid, prefix_token_ids, SamplingParams(max_tokens=1),
                                             cache_salt=cache_salt)
            async for _ in self.server.batches(rid, stream):
                pass
        await self.server.call(lambda _e: sending.connector.send_prefix(pull_id, block_hashes, descriptor))
        event = await sending.wait(self.server, pull_id)
        if event.state is not TransferState.DONE:
            raise TransferFailedError(pull_id, event.state, event.error)

    async def keep_prefix(self, pull_id: str) -> int:
        """Waits for a reserved prefix's KV and keeps it in the prefix cache (parked); returns its blocks. Raises
        TransferFailedError if it did not arrive (nothing is held then)."""
        receiving = self._pull_loop(self._receiving)
        event = await receiving.wait(self.server, pull_id)
        if event.state is not TransferState.DONE:
            raise TransferFailedError(pull_id, event.state, event.error)
        return await self.server.call(lambda _e: receiving.connector.keep_prefix(pull_id))

    async def load_lora(self, name: str, path: str) -> float:
        return await self.server.call(lambda e: e.load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        await self.server.call(lambda e: e.unload_lora(name))

    def _pull_loop(self, loop: ConnectorLoop | None) -> ConnectorLoop:
        if loop is None:
            raise ValueError(f"{self.name} has no KV transfer agents (colocated): it takes no prefix pulls")
        return loop

    async def check_integrity(self) -> None:
        """Raises ValueError if the replica's KV bookkeeping, or any rank's KV transfer agent, is inconsistent
        (runs on the engine thread)."""
        def check(engine: LLMEngine) -> None:
            engine.check_integrity()
            if self.connector is not None:
                self.connector.agents.check_integrity()

        await self.server.call(check)

    async def inject_fault(self, fault: str) -> str:
        """A failure drill, for fault-injection tests and game days (not part of the router's contract):
        "drop_kv_connections" fails every KV transfer this replica's ranks are sending and closes their
        connections, as a network drop would. Returns what it did. Raises ValueError for another fault."""
        if fault != "drop_kv_connections":
            raise ValueError(f"unknown fault {fault!r}; known: drop_kv_connections")
        if self.connector is None:
            raise ValueError(f"{self.name} has no KV transfer agents (colocated)")
        failed = await self.server.call(lambda _e: self.connector.agents.drop_connections("dropped by a drill"))
        return f"{failed} transfer(s) failed on {self.name}"

    async def channel_endpoint(self) -> ChannelEndpoint:
        """Where the router connects for this replica's token channel (replica/token_channel.py), started on
        first ask on this node's address, with the secret it must prove."""
        return await self._channel.start(node_address())

    async def stream_on_channel(self, connection: int, key: int, call: StreamCall) -> ChannelEnd:
        """Runs the stream `call` names (one of self.streams) and writes each batch it yields on the token
        channel's `connection` under `key`; returns how many it wrote and the exception it ended with (returned,
        not raised, so that the router raises it after the batches before it)."""
        sent = 0
        try:
            async for batch in self.stream(call):
                await self._channel.send(connection, key, batch)
                sent += 1
        except Exception as e:
            return ChannelEnd(sent, e)
        return ChannelEnd(sent)

    async def stream(self, call: StreamCall) -> AsyncIterator[list[RequestOutput]]:
        """The batches of the stream `call` names: what stream_on_channel sends, and the Ray streaming call the
        router makes where it has no token channel. Raises TypeError for a call this role does not answer."""
        if not isinstance(call, self.streams):
            raise TypeError(f"a {self.pool} replica runs no {type(call).__name__} stream")
        async for batch in call.open(self):
            yield batch

    async def shutdown(self) -> None:
        await self._channel.close()
        await self.server.stop()
        await asyncio.to_thread(self.engine.shutdown)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # sends the last spans (it may wait on the network)

    # -- for the roles -----------------------------------------------------------------------------------

    def _trace(self, trace: str | None, name: str, request_id: str) -> CallTrace | Untraced:
        """The recorder of a call the router traces (trace: its traceparent), writing span `name` when it ends;
        one that records nothing when the call is not traced or this replica has no tracer."""
        return UNTRACED if self.tracer is None else self.tracer.call(trace, name, request_id)

    def _mark_aborted(self, request_id: str) -> None:
        now = self.clock()
        self._aborted[request_id] = now
        for rid in [r for r, t in self._aborted.items() if t < now - ABORT_MEMORY_S]:
            del self._aborted[rid]

    def _check_not_aborted(self, request_id: str) -> None:
        """Raises RequestAbortedError if abort() was called for request_id (within ABORT_MEMORY_S)."""
        if request_id in self._aborted:
            raise RequestAbortedError(f"request {request_id!r} was aborted")
