"""The transfer agent of one rank: it lives beside that rank's KV store (in the rank's process) and moves its
share of each request's KV.

Peers are not trusted. Every message carries a MAC under the cluster's secret (kv_transfer/wire.py); the
pump takes every message off the wire through an Inbox (kv_transfer/inbox.py), which never allocates what a
message names, and acts only on messages whose MAC checks out. Everything else is dropped and counted by
reason (kv_transfer/drops.py, in stats()), without touching any transfer. No address is ever taken from a
message: the receiving side answers only the sending replica's addresses the reservation named (expect's
senders), the sending side only the descriptor's.

Receiving (decode rank): expect() registers the request's destination blocks, lease and senders. The pump
receives each DATA message of a held transfer that fits the reservation into a staging slot, checks its MAC
and header, copies the payload into the KV blocks and, once the header's message count has arrived,
acknowledges every source rank seen (ACK OK, to senders[rank]). An authentic message that does not fit the
reservation, the lease passing, or an ABORT from the sender end the transfer in FAILED / EXPIRED / ABORTED,
and each source rank seen is told. Each source rank also says when it has sent everything (an ACK OK from the
source side); once all the named senders said so, a transfer still missing messages that are not arriving
fails SENT_GRACE_S later (every named sender told): a message lost or corrupted on the wire (dropped by its MAC
check) fails its transfer within a second instead of at its lease, and a forged copy of a message cannot. An
authentic message of a transfer that already ended (still held, or forgotten and remembered by a tombstone) is
answered with that outcome, so no sender waits on it; messages of transfers the agent never held are dropped.
With no senders, nobody is answered: the senders then learn the outcome from their own leases.

Sending (prefill rank): arm() computes the plan's messages for this rank. The model runner calls
on_layers_done() after each layer; every message whose last layer that is leaves at once (gathered from the
KV store into a staging slot, sealed with its MAC, sent without blocking), so sending overlaps the next
layers' compute. send_all() sends everything at once (KV already computed). Within one call the copy of
message i+1 is started before message i is sealed and sent (on a GPU the two overlap; on the CPU the copy is
synchronous). Once every message went out, every destination rank is told so (ACK OK). The transfer is DONE
when every destination rank it feeds has acknowledged; a failed send, a negative acknowledgement or the lease
passing end it otherwise, and its destination ranks are told (ABORT).

Same host: where a destination rank's descriptor names this agent's shared-memory domain, its DATA messages go
by reference (kv_transfer/shm.py): only the header (with a ref and the MAC) crosses the transport. A message
whose source blocks are one run of a shared KV store points into the store (no copy here; the blocks' owner
holds them until the transfer ends); any other goes through the staging buffer, a memfd too, and the receiver
copies the payload from the sender's slot into its blocks. Such slots are held until that rank's ACK (or, once
the transfer ended otherwise, given back with their stamps cleared, which fails a copy still reading them).
send_all waits up to config.room_wait_s for a shared slot when the pool is full; the runner's hook never waits.
A message that found no shared slot goes with its payload. stats() says whether the path is on (and why not)
and counts messages sent by reference, and of those the ones sent from the store.

Devices: the KV store lives on the CPU or a CUDA device; a KVCopier (device_copy.py) does every copy between it
and the staging slots, so this file is the same for both. The path, chosen once: "staged" (host slots, pinned
beside a CUDA store) or "direct" (device-side slots the transport sends and receives as they are; their host
mirror carries the header and the MAC). See TransferConfig.kv_path; stats() reports it.

The agent composes its two sides, kv_transfer/agent_receiver.py (AgentReceiver) and kv_transfer/agent_sender.py
(AgentSender), over what they share (kv_transfer/agent_context.py); it owns the lock and the pump, and answers the
driver's calls that span both (abort, poll, release, stats).

Threads: the driver's calls (expect, arm, abort, poll, release) and the runner's hook take the agent's lock
for bookkeeping only; copies and MACs run outside it (the pump checks received messages between two turns of
holding it), except the copy into KV blocks, which holds the lock so that abort() returning means no more
writes into those blocks. Nothing waits on the network under the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from tandem.engine.kv.kv_cache import PagedKVCache, kv_dtype_name
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.kv_transfer.agent_context import AgentContext
from tandem.kv_transfer.agent_receiver import AgentReceiver
from tandem.kv_transfer.agent_sender import AgentSender
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat, RankStatus, TransferDescriptor, TransferState
from tandem.kv_transfer.device_copy import KVCopier
from tandem.kv_transfer.drops import DropCounter, MessageDrops
from tandem.kv_transfer.inbox import ControlMessage, DataMessage, Inbox, Received
from tandem.kv_transfer.replies import Replies
from tandem.kv_transfer.shm import SharedSegment, domain
from tandem.kv_transfer.staging import StagingPool
from tandem.kv_transfer.transport import Transport
from tandem.kv_transfer.wire import Kind, MessageKey, transfer_key

_log = logging.getLogger(__name__)
FIRST_WAIT_S = 0.0002  # the pump's wait after a turn that moved something, while a transfer is open


@dataclass(frozen=True)
class AgentStats:
    num_inbound: int
    num_outbound: int
    staging_in_use: int
    staging_free_bytes: int
    one_off_buffers: int  # sends that found the staging buffer full
    device: str  # where the KV store lives: "cpu", "cuda:0", ...
    path: str  # "staged" (host staging slots) | "direct" (device-side slots handed to the transport)
    drops: MessageDrops  # messages dropped unread or unacted on, by reason, since the agent started
    shared_memory: str = "off"  # "on", or "off (why)": same-host messages by reference (kv_transfer/shm.py)
    by_reference: int = 0  # DATA messages sent by reference since the agent started
    from_store: int = 0  # of those, the ones whose ref points into the KV store itself (no copy on this side)
    bytes_sent: int = 0  # KV payload bytes of the DATA messages sent since the agent started
    bytes_received: int = 0  # and of the authentic DATA messages received and written into blocks


class KVTransferAgent:
    def __init__(self, kv_cache: PagedKVCache, layout: ReplicaLayout, rank: int, transport: Transport,
                 config: TransferConfig = TransferConfig(), *, clock: Callable[[], float] = time.time):
        self.kv = kv_cache
        self.layout = layout
        self.rank = rank
        self.transport = transport
        self.config = config
        shard = layout.shard(rank)
        spec = kv_cache.spec
        if (spec.num_layers, spec.num_kv_heads) != (len(shard.layers), len(shard.kv_heads)):
            raise ValueError(f"rank {rank}'s KV store holds {spec.num_layers} layers x {spec.num_kv_heads} KV heads, "
                             f"its layout share is {len(shard.layers)} x {len(shard.kv_heads)}")
        self.format = KVFormat(layout.num_layers, layout.num_kv_heads, spec.head_dim, spec.block_size,
                               kv_dtype_name(spec.dtype))
        key = MessageKey(config.secret)
        self.copier = KVCopier(kv_cache.data, shard.layers, shard.kv_heads)
        self.path = self.copier.choose_path(config.kv_path, transport.device_transports, rank)
        shm, self.shared_memory = self._shared_staging()
        staging = StagingPool(config.staging_bytes, self.copier.host_buffer,
                              self.copier.device_buffer if self.path == "direct" else None,
                              buffer=None if shm is None else shm.buffer)
        drops = DropCounter(rank)
        self.ctx = AgentContext(rank, config, clock, transport, key, self.format, shard.layers, shard.kv_heads,
                                self.copier, staging, shm, domain() if shm is not None else "",
                                Replies(transport, key, rank), drops)
        self.inbox = Inbox(transport, key, staging, drops, self.copier.to_host)
        self.receiver = AgentReceiver(self.ctx)
        self.sender = AgentSender(self.ctx, kv_cache, layout)
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._run, name=f"kv-agent-{rank}", daemon=True)
        self._pump.start()

    @property
    def address(self) -> str:
        return self.transport.address

    def _shared_staging(self) -> tuple[SharedSegment | None, str]:
        """The shared staging buffer, or None and why the same-host path is off."""
        if not self.config.shared_memory:
            return None, "off (shared_memory: false)"
        if self.path != "staged" or self.copier.on_cuda:
            return None, f"off (KV store on {self.copier.device})"
        if not domain():
            return None, "off (needs Linux on x86-64 with /proc)"
        try:
            return SharedSegment(self.config.staging_bytes), "on"
        except OSError as e:
            _log.warning("rank %d: no shared staging (%s); same-host transfers go through the transport",
                         self.rank, e)
            return None, f"off (cannot make a memfd: {e})"

    def shares_kv_store(self) -> bool:
        """Whether same-host receivers read this rank's KV store itself (its blocks must outlive the requests
        sent from them until the transfer ends: PrefillConnector holds them)."""
        return self.sender.store_segment is not None

    def shared_memory_domain(self) -> str:
        """The domain same-host senders must share to send this rank payloads by reference ("" : none)."""
        return self.ctx.shm_domain

    def _check_free(self, transfer_id: str) -> None:
        key = transfer_key(transfer_id)
        if key in self.receiver.inbound or key in self.sender.outbound:
            raise ValueError(f"transfer {transfer_id!r} is already registered on rank {self.rank}")

    # -- receiving side ------------------------------------------------------------------------------------

    def expect(self, transfer_id: str, block_ids: Sequence[int], deadline: float,
               senders: Sequence[str] = ()) -> None:
        """Registers destination blocks (block ids of this rank's store, in token order) for a transfer.
        senders: the sending replica's agent addresses by rank, the only peers told how it went (empty: nobody;
        they learn it from their leases). Raises ValueError for a transfer id already held, block ids that
        repeat, or senders given as one string."""
        with self.ctx.lock:
            self._check_free(transfer_id)
            self.receiver.expect(transfer_id, block_ids, deadline, senders)

    # -- sending side --------------------------------------------------------------------------------------

    def arm(self, descriptor: TransferDescriptor, seq_id: str | None = None) -> None:
        """Prepares this rank's messages for descriptor. With seq_id, on_layers_done sends them as the
        sequence's layers are computed, config.layer_group layers a message; without, call send_all, which
        sends all layers of a piece together (the fewest, largest messages). Messages carry this store's dtype
        (the receiver converts them to its own). Raises ValueError if the KV formats differ in anything but
        the dtype or the transfer id is in use here."""
        with self.ctx.lock:
            self._check_free(descriptor.transfer_id)
            self.sender.arm(descriptor, seq_id)

    def on_layers_done(self, layer: int, tables: Mapping[str, Sequence[int]]) -> None:
        """The runner's hook: `layer` (global index) is computed for the sequences in tables (seq id -> block
        table) whose prompt this step completes. Sends every armed message ending at that layer."""
        with self.ctx.lock:
            armed = [o for o in self.sender.outbound.values() if o.seq_id in tables and not o.state.terminal]
        for out in armed:
            ready = [m for m in out.messages if m.layers.stop - 1 == layer and m.index not in out.sent]
            self.sender.send(out, ready, tables[out.seq_id])

    def send_all(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Sends every message of an armed transfer now, from source blocks block_ids (in token order)."""
        with self.ctx.lock:
            out = self.sender.outbound.get(transfer_key(transfer_id))
        if out is None:
            raise ValueError(f"transfer {transfer_id!r} is not armed on rank {self.rank}")
        self.sender.send(out, [m for m in out.messages if m.index not in out.sent], block_ids, wait=True)

    # -- both sides ----------------------------------------------------------------------------------------

    def listen_address(self) -> str:
        return self.transport.address

    def abort(self, transfer_id: str, reason: str = "aborted", expired: bool = False) -> None:
        """Ends the transfer on this rank as ABORTED (or EXPIRED) unless it already ended, and tells the peers.
        Once this returns, nothing more is written into the transfer's destination blocks here."""
        key = transfer_key(transfer_id)
        state = TransferState.EXPIRED if expired else TransferState.ABORTED
        with self.ctx.lock:
            self.receiver.end(key, state, reason)
            self.sender.end(key, state, reason)

    def poll(self, transfer_ids: Sequence[str] | None = None) -> dict[str, RankStatus]:
        """Each transfer's state on this rank (all of them when transfer_ids is None; unknown ids are left
        out). Never blocks on the network."""
        with self.ctx.lock:
            transfers = [*self.receiver.inbound.values(), *self.sender.outbound.values()]
            wanted = None if transfer_ids is None else set(transfer_ids)
            return {t.transfer_id: RankStatus(t.state, t.nbytes, t.error) for t in transfers
                    if wanted is None or t.transfer_id in wanted}

    def release(self, transfer_id: str) -> None:
        """Forgets an ended transfer (aborting it first if it is still running); late messages for it are then
        answered with its outcome for tombstone_s (receiving side: to the senders it was expected from)."""
        key = transfer_key(transfer_id)
        self.abort(transfer_id, "released")
        with self.ctx.lock:
            self.receiver.forget(key)
            self.sender.forget(key)

    def store_reads_pending(self, transfer_ids: Sequence[str]) -> set[str]:
        """Those of transfer_ids whose refs into this rank's KV store a destination rank may still read: sent to
        it, and no ACK from it since (an ACK of any status means it reads nothing more of the transfer)."""
        with self.ctx.lock:
            return {t for t in transfer_ids if self.sender.reads_pending(transfer_key(t))}

    def source_blocks(self, transfer_id: str) -> tuple[int, ...]:
        """The source blocks an armed transfer sends from (empty before its first send; tests, debugging)."""
        with self.ctx.lock:
            out = self.sender.outbound.get(transfer_key(transfer_id))
            return out.source_blocks if out else ()

    def read_kv(self, block_ids: Sequence[int]) -> np.ndarray:
        """A float32 host copy of this rank's K/V of block_ids: [layers, 2, blocks, KV heads, block_size,
        head_dim] (tests)."""
        return self.copier.read(block_ids)

    def stats(self) -> AgentStats:
        ctx, sender = self.ctx, self.sender
        with ctx.lock:
            return AgentStats(len(self.receiver.inbound), len(sender.outbound), ctx.staging.num_in_use,
                              ctx.staging.free_bytes, sender.one_off_buffers, str(self.copier.device), self.path,
                              ctx.drops.snapshot(), self.shared_memory, sender.by_reference, sender.from_store,
                              sender.bytes_sent, self.receiver.bytes_received)

    def check_integrity(self) -> None:
        """Raises ValueError if a staging slot is held with nothing in flight."""
        with self.ctx.lock:
            in_flight = self.inbox.slots_in_flight + self.sender.slots_in_flight()
            if in_flight != self.ctx.staging.num_in_use:
                raise ValueError(f"{self.ctx.staging.num_in_use} staging slots held, {in_flight} messages in flight")
            self.ctx.staging.check_integrity()

    def drop_connections(self, reason: str = "the connection dropped") -> int:
        """What a network drop does to this rank, for failure drills (ReplicaShell.inject_fault): every
        outbound transfer still running fails (its receivers are told, over a new connection) and every
        connection this agent opened is closed. Returns how many transfers failed."""
        with self.ctx.lock:
            return self.sender.drop_connections(reason)

    def close(self) -> None:
        """Stops the pump and the transport (idempotent). Transfers still running here end with the peers'
        leases."""
        self._stop.set()
        self._pump.join(timeout=5)
        self.transport.close()
        if self.ctx.shm is not None:
            self.ctx.shm.close()

    # -- the pump ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.copier.bind_thread()  # this thread posts receives into device-side slots
        except Exception as e:  # such receives then fail (and are dropped) instead of the pump
            _log.warning("rank %d: could not make %s current on the transfer thread: %s", self.rank,
                         self.copier.device, e)
        wait = FIRST_WAIT_S
        while not self._stop.is_set():
            try:
                busy = self._turn()
                with self.ctx.lock:
                    transfers = (*self.receiver.inbound.values(), *self.sender.outbound.values())
                    active = bool(self.inbox.busy or self.ctx.replies.busy or
                                  any(not t.state.terminal for t in transfers))
            except Exception as e:  # a bug here, not a peer's message: fail what is running and go on
                _log.exception("rank %d: transfer agent error", self.rank)
                self._fail_everything(f"transfer agent error: {type(e).__name__}: {e}")
                busy = active = False
            # While a transfer is open, nothing moving makes the pump wait twice as long before its next turn, up
            # to idle_poll_s: a prefill of a long prompt keeps its transfer open for seconds, and turns every
            # 0.2 ms would take the cores that the prefill and decode steps run on.
            if busy:
                wait = FIRST_WAIT_S
            else:
                wait = min(2 * wait, self.config.idle_poll_s) if active else self.config.idle_poll_s
                time.sleep(wait)

    def _turn(self) -> bool:
        """One pump turn: posts receives for what arrived, checks the finished ones outside the lock (MACs),
        acts on the authentic ones, then finishes sends and checks leases. Returns whether anything moved."""
        with self.ctx.lock:
            busy = self.inbox.post(self.receiver.room)
            finished = self.inbox.finished()
        opened = [(received, self._open(received)) for received in finished]
        with self.ctx.lock:
            for received, message in opened:
                try:
                    if isinstance(message, DataMessage):
                        self.receiver.on_data(message)
                    elif isinstance(message, ControlMessage):
                        self._on_control(message)
                except Exception as e:  # ends the one transfer the message authenticated for
                    _log.exception("rank %d: handling a message under tag %#x", self.rank, received.tag)
                    self._fail(message.key, f"transfer agent error: {type(e).__name__}: {e}")
                finally:
                    self.inbox.release(received)
            self.ctx.replies.prune()
            busy |= bool(finished) | self.sender.finish_sends()
            self._check_deadlines()
        return busy

    def _open(self, received: Received) -> DataMessage | ControlMessage | None:
        """inbox.open(received), or None (logged) if checking it failed here (a device copy), not by its bytes."""
        try:
            return self.inbox.open(received)
        except Exception:
            _log.exception("rank %d: checking a message under tag %#x", self.rank, received.tag)
            return None

    def _fail_everything(self, reason: str) -> None:
        with self.ctx.lock:
            for t in [*self.receiver.inbound.values(), *self.sender.outbound.values()]:
                t.end(TransferState.FAILED, reason)

    def _fail(self, key: int, reason: str) -> None:
        self.receiver.end(key, TransferState.FAILED, reason)
        self.sender.end(key, TransferState.FAILED, reason)

    def _on_control(self, control: ControlMessage) -> None:
        key, kind, status, rank = control.key, control.kind, control.message.status, control.message.rank
        if kind is Kind.ACK and (self.sender.on_ack(key, status, rank) or self.receiver.on_sent(key, status, rank)):
            return
        if kind is Kind.ABORT and self.receiver.on_abort(key, status, rank):
            return
        if key in self.sender.outbound or key in self.receiver.inbound or key in self.ctx.tombstones:
            self.ctx.drops.count("late", f"{kind.name} {status.name} from rank {rank} for a transfer that ended")
        else:
            self.ctx.drops.count("unknown_transfer", f"{kind.name} from rank {rank} for key {key:#x}")

    def _check_deadlines(self) -> None:
        now = self.ctx.clock()
        self.receiver.expire(now, self.inbox.arriving)
        self.sender.expire(now)
        cutoff = now - self.config.tombstone_s
        self.ctx.tombstones = {k: t for k, t in self.ctx.tombstones.items() if t.ended_at >= cutoff}
