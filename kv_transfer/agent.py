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
and each source rank seen is told. An authentic message of a transfer that already ended (still held, or
forgotten and remembered by a tombstone) is answered with that outcome, so no sender waits on it; messages of
transfers the agent never held are dropped. With no senders, nobody is answered: the senders then learn the
outcome from their own leases.

Sending (prefill rank): arm() computes the plan's messages for this rank. The model runner calls
on_layers_done() after each layer; every message whose last layer that is leaves at once (gathered from the
KV store into a staging slot, sealed with its MAC, sent without blocking), so sending overlaps the next
layers' compute. send_all() sends everything at once (KV already computed). Within one call the copy of
message i+1 is started before message i is sealed and sent (on a GPU the two overlap; on the CPU the copy is
synchronous). The transfer is DONE when every destination rank it feeds has acknowledged; a failed send, a
negative acknowledgement or the lease passing end it otherwise, and its destination ranks are told (ABORT).

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

from tandem.engine.kv_cache import KV_STORAGE, PagedKVCache, kv_dtype_name
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat, RankStatus, TransferDescriptor, TransferState
from tandem.kv_transfer.device_copy import KVCopier, PendingCopy
from tandem.kv_transfer.drops import DropCounter, MessageDrops
from tandem.kv_transfer.inbox import ControlMessage, DataMessage, Inbox, Received
from tandem.kv_transfer.plan import Message, plan_messages, plan_pieces
from tandem.kv_transfer.rank_transfer import STATE_FOR, STATUS_FOR, Inbound, Outbound, Tombstone
from tandem.kv_transfer.replies import Replies
from tandem.kv_transfer.shm import HEADER_PAGE, PeerSegments, SharedSegment, ShmUnavailable, domain, readable
from tandem.kv_transfer.staging import Slot, StagingPool
from tandem.kv_transfer.transport import Transport
from tandem.kv_transfer.wire import HEADER_BYTES, DataHeader, Kind, MessageKey, ShmRef, Status, make_tag, transfer_key

ORPHAN_GRACE_S = 5.0
_log = logging.getLogger(__name__)


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


@dataclass
class _Gathered:
    """A message whose copy into its staging slot has started (not necessarily finished)."""

    message: Message
    slot: Slot
    copy: PendingCopy


class KVTransferAgent:
    def __init__(self, kv_cache: PagedKVCache, layout: ReplicaLayout, rank: int, transport: Transport,
                 config: TransferConfig = TransferConfig(), *, clock: Callable[[], float] = time.time):
        self.kv = kv_cache
        self.layout = layout
        self.rank = rank
        self.transport = transport
        self.config = config
        self.clock = clock
        shard = layout.shard(rank)
        self.layers, self.kv_heads = shard.layers, shard.kv_heads
        spec = kv_cache.spec
        if (spec.num_layers, spec.num_kv_heads) != (len(self.layers), len(self.kv_heads)):
            raise ValueError(f"rank {rank}'s KV store holds {spec.num_layers} layers x {spec.num_kv_heads} KV heads, "
                             f"its layout share is {len(self.layers)} x {len(self.kv_heads)}")
        self.format = KVFormat(layout.num_layers, layout.num_kv_heads, spec.head_dim, spec.block_size,
                               kv_dtype_name(spec.dtype))
        self.key = MessageKey(config.secret)
        self.copier = KVCopier(kv_cache.data, self.layers, self.kv_heads)
        self.path = self.copier.choose_path(config.kv_path, transport.device_transports, rank)
        self.shm, self.shared_memory = self._shared_staging()
        # The KV store itself in shared memory (AgentFactory.share_kv_store): same-host receivers read from it.
        owner = kv_cache.memory_owner
        self.store_segment = owner if isinstance(owner, SharedSegment) and self.shm is not None else None
        self.shm_domain = domain() if self.shm is not None else ""
        self.staging = StagingPool(config.staging_bytes, self.copier.host_buffer,
                                   self.copier.device_buffer if self.path == "direct" else None,
                                   buffer=None if self.shm is None else self.shm.buffer)
        self.peer_segments = PeerSegments()
        self.one_off_buffers = 0
        self.by_reference = self.from_store = 0
        self.drops = DropCounter(rank)
        self.inbox = Inbox(transport, self.key, self.staging, self.drops, self.copier.to_host)
        self.replies = Replies(transport, self.key, rank)
        self._lock = threading.RLock()
        self._slot_freed = threading.Condition(self._lock)
        self._in: dict[int, Inbound] = {}
        self._out: dict[int, Outbound] = {}
        self._tombstones: dict[int, Tombstone] = {}
        # Released transfers whose refs into the KV store some destination ranks may still read: key -> (those
        # ranks, released at). A rank's ACK (any status) says it is done with them: it reads nothing after it.
        self._store_readers: dict[int, tuple[set[int], float]] = {}
        # Sends of released transfers still on the wire: (handle, slot, peer, released at). One not done within
        # ORPHAN_GRACE_S has a silent or dead peer: its connection is closed, which ends it.
        self._orphans: list[tuple[object, Slot, str, float]] = []
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
        return self.store_segment is not None

    def shared_memory_domain(self) -> str:
        """The domain same-host senders must share to send this rank payloads by reference ("" : none)."""
        return self.shm_domain

    # -- receiving side ------------------------------------------------------------------------------------

    def expect(self, transfer_id: str, block_ids: Sequence[int], deadline: float,
               senders: Sequence[str] = ()) -> None:
        """Registers destination blocks (block ids of this rank's store, in token order) for a transfer.
        senders: the sending replica's agent addresses by rank, the only peers told how it went (empty: nobody;
        they learn it from their leases). Raises ValueError for a transfer id already held, block ids that
        repeat, or senders given as one string."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"transfer {transfer_id!r}: destination block ids repeat: {list(block_ids)}")
        if isinstance(senders, str):
            raise ValueError(f"transfer {transfer_id!r}: senders must be a sequence of addresses, got {senders!r}")
        # The sender's dtype is learnt from its messages: room for the widest a peer may send.
        share = len(block_ids) * len(self.layers) * len(self.kv_heads) * self.format.largest_bytes_per_block_layer_head
        key = transfer_key(transfer_id)
        with self._lock:
            if key in self._in or key in self._out:
                raise ValueError(f"transfer {transfer_id!r} is already registered on rank {self.rank}")
            self._tombstones.pop(key, None)
            self._in[key] = Inbound(transfer_id, deadline, block_ids=tuple(block_ids), senders=tuple(senders),
                                    max_message=HEADER_BYTES + min(self.config.max_message_bytes, share))

    # -- sending side --------------------------------------------------------------------------------------

    def arm(self, descriptor: TransferDescriptor, seq_id: str | None = None) -> None:
        """Prepares this rank's messages for descriptor. With seq_id, on_layers_done sends them as the
        sequence's layers are computed, config.layer_group layers a message; without, call send_all, which
        sends all layers of a piece together (the fewest, largest messages). Messages carry this store's dtype
        (the receiver converts them to its own). Raises ValueError if the KV formats differ in anything but
        the dtype or the transfer id is in use here."""
        self.format.check_matches(descriptor.kv, dtype=False)
        pieces = plan_pieces(self.layout, descriptor.layout)
        group = self.config.layer_group if seq_id is not None else self.layout.num_layers
        messages = plan_messages(pieces, len(descriptor.block_ids), layer_group=group,
                                 max_message_bytes=self.config.max_message_bytes,
                                 bytes_per_block_layer_head=self.format.bytes_per_block_layer_head)
        counts: dict[int, int] = {}
        for m in messages:
            counts[m.dst_rank] = counts.get(m.dst_rank, 0) + 1
        mine = tuple(m for m in messages if m.src_rank == self.rank)
        key = transfer_key(descriptor.transfer_id)
        with self._lock:
            if key in self._in or key in self._out:
                raise ValueError(f"transfer {descriptor.transfer_id!r} is already registered on rank {self.rank}")
            out = Outbound(descriptor.transfer_id, descriptor.deadline, descriptor=descriptor, seq_id=seq_id,
                            messages=mine, counts=counts)
            if not mine:
                out.state = TransferState.DONE  # another replica of this rank's KV heads feeds every destination
            self._out[key] = out

    def on_layers_done(self, layer: int, tables: Mapping[str, Sequence[int]]) -> None:
        """The runner's hook: `layer` (global index) is computed for the sequences in tables (seq id -> block
        table) whose prompt this step completes. Sends every armed message ending at that layer."""
        with self._lock:
            armed = [o for o in self._out.values() if o.seq_id in tables and not o.state.terminal]
        for out in armed:
            ready = [m for m in out.messages if m.layers.stop - 1 == layer and m.index not in out.sent]
            self._send_messages(out, ready, tables[out.seq_id])

    def send_all(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Sends every message of an armed transfer now, from source blocks block_ids (in token order)."""
        with self._lock:
            out = self._out.get(transfer_key(transfer_id))
        if out is None:
            raise ValueError(f"transfer {transfer_id!r} is not armed on rank {self.rank}")
        self._send_messages(out, [m for m in out.messages if m.index not in out.sent], block_ids, wait=True)

    def _send_messages(self, out: Outbound, messages: list[Message], block_ids: Sequence[int],
                       wait: bool = False) -> None:
        """Gathers and sends messages in order, one copy ahead: message i+1's copy is started before message
        i is sealed and sent. Stops at a terminal state or a release; a copy started and not sent gives
        its slot back. wait: a full shared staging pool is waited on (send_all), not sent around."""
        out.source_blocks = tuple(block_ids)
        ahead: _Gathered | None = None
        try:
            for m in messages:
                if out.state.terminal:
                    break
                if self._send_from_store(out, m, block_ids):
                    continue
                current, ahead = ahead, self._gather(m, block_ids, out if wait else None)
                if current is not None and not self._post(out, current):
                    break
            else:
                if ahead is not None:
                    current, ahead = ahead, None
                    self._post(out, current)
        finally:
            if ahead is not None:
                self._drop(ahead)

    def _gather(self, m: Message, block_ids: Sequence[int], waiting: Outbound | None = None) -> _Gathered:
        """Takes a slot for m (waiting for one on behalf of `waiting`, see _slot) and starts copying m's slice
        of the KV store into it."""
        slot = self._slot(HEADER_BYTES + m.nbytes(self.format.bytes_per_block_layer_head), waiting)
        rows = [block_ids[b] for b in m.blocks]
        device_payload = None if slot.device is None else slot.device[HEADER_BYTES:]
        try:
            copy = self.copier.gather_into(slot.view[HEADER_BYTES:], m.layers, m.kv_heads, rows, device_payload)
        except BaseException:
            with self._lock:
                self._give_back([slot])
            raise
        return _Gathered(m, slot, copy)

    def _post(self, out: Outbound, g: _Gathered) -> bool:
        """Waits for g's copy, seals it (header and MAC) and sends it. False (and nothing sent, or the send left to finish
        as an orphan) once the transfer has ended or was released."""
        try:
            g.copy.wait()
            if out.state.terminal:
                self._drop(g)
                return False
            m, slot = g.message, g.slot
            key = transfer_key(out.descriptor.transfer_id)
            nbytes = m.nbytes(self.format.bytes_per_block_layer_head)
            tag = make_tag(key, Kind.DATA, m.index)
            by_reference = (self.shm is not None and slot.offset >= 0 and
                            out.descriptor.shm_domain(m.dst_rank) == self.shm_domain)
            ref = self.shm.ref(slot.offset + HEADER_BYTES, nbytes) if by_reference else None
            header = DataHeader(m.index, out.counts[m.dst_rank], self.rank, m.layers, m.kv_heads, m.blocks, nbytes,
                                ref, self.format.dtype)
            sealed = np.frombuffer(header.seal(self.key, tag, slot.view[HEADER_BYTES:]), dtype=np.uint8)
            if by_reference:  # the header and the ref go; the payload stays in the slot for the receiver
                wire = np.concatenate([sealed, np.frombuffer(ref.pack(), dtype=np.uint8)])
            else:
                slot.view[:HEADER_BYTES] = sealed
                if slot.device is not None:
                    self.copier.to_device(slot.view[:HEADER_BYTES], slot.device[:HEADER_BYTES])
                wire = slot.wire
            peer = out.descriptor.addresses[m.dst_rank]
            handle = self.transport.send(peer, tag, wire)
        except BaseException:
            self._drop(g)
            raise
        return self._record(out, key, m, handle, peer, nbytes, slot, by_reference)

    def _record(self, out: Outbound, key: int, m: Message, handle, peer: str, nbytes: int, slot: Slot | None,
                by_reference: bool) -> bool:
        """Books a message just sent (from slot, None: from the KV store); False if the transfer was released
        meanwhile (the send is left to finish as an orphan)."""
        pending = None if by_reference else slot
        with self._lock:
            if self._out.get(key) is not out:  # released while this message was gathered
                if by_reference and slot is not None:
                    self._give_back([slot], reread=True)
                self._orphans.append((handle, pending, peer, time.monotonic()))
                return False
            out.sent.add(m.index)
            out.pending.append((handle, pending, peer))
            if by_reference:
                if slot is not None:
                    out.held.setdefault(m.dst_rank, []).append(slot)
                self.by_reference += 1
            out.nbytes += nbytes
            if out.state is TransferState.RESERVED:
                out.state = TransferState.TRANSFERRING
        return True

    def _send_from_store(self, out: Outbound, m: Message, block_ids: Sequence[int]) -> bool:
        """Sends m as a ref into this rank's shared KV store (no copy here: the receiver reads the blocks) where
        the store is shared, the destination rank is in this domain and m's source blocks are one run; False
        (nothing sent) otherwise."""
        if self.store_segment is None or out.descriptor.shm_domain(m.dst_rank) != self.shm_domain:
            return False
        rows = [block_ids[b] for b in m.blocks]
        if rows != list(range(rows[0], rows[0] + len(rows))) or rows[0] < 0 or rows[-1] >= self.kv.data.shape[2]:
            return False
        data = self.kv.data
        start = data[m.layers.start - self.layers.start, 0, rows[0], m.kv_heads.start - self.kv_heads.start]
        size = data.element_size()
        key = transfer_key(out.descriptor.transfer_id)
        nbytes = m.nbytes(self.format.bytes_per_block_layer_head)
        ref = ShmRef(self.store_segment.pid, self.store_segment.fd, self.store_segment.nonce,
                     HEADER_PAGE + start.data_ptr() - data.data_ptr(), nbytes, 0,
                     tuple(stride * size for stride in data.stride()[:3]))
        tag = make_tag(key, Kind.DATA, m.index)
        header = DataHeader(m.index, out.counts[m.dst_rank], self.rank, m.layers, m.kv_heads, m.blocks, nbytes, ref,
                            self.format.dtype)
        wire = np.frombuffer(header.seal(self.key, tag, b"") + ref.pack(), dtype=np.uint8)
        peer = out.descriptor.addresses[m.dst_rank]
        if self._record(out, key, m, self.transport.send(peer, tag, wire), peer, nbytes, None, True):
            with self._lock:
                self.from_store += 1
                out.store_readers.add(m.dst_rank)
        return True

    def _drop(self, g: _Gathered) -> None:
        """Gives back the slot of a message that will not be sent, once its copy no longer writes into it."""
        g.copy.wait()
        with self._lock:
            self._give_back([g.slot])

    def _slot(self, nbytes: int, waiting: Outbound | None = None) -> Slot:
        """A staging slot, else a one-off buffer (counted). With `waiting` and shared staging, a full pool is
        waited on for up to config.room_wait_s, unless that transfer already holds half the pool itself (its
        own slots come back only with its ACK) or already waited in vain once."""
        with self._lock:
            slot = self.staging.acquire(nbytes)
            held = sum(s.size for slots in waiting.held.values() for s in slots) if waiting is not None else 0
            if (slot is None and waiting is not None and self.shm is not None and not waiting.waited_in_vain and
                    held + nbytes <= self.staging.capacity // 2):
                deadline = time.monotonic() + self.config.room_wait_s
                while slot is None and (left := deadline - time.monotonic()) > 0:
                    self._slot_freed.wait(min(left, 0.01))
                    slot = self.staging.acquire(nbytes)
                waiting.waited_in_vain = slot is None
            if slot is None:
                self.one_off_buffers += 1
                slot = self.staging.one_off(nbytes)
            return slot

    def _give_back(self, slots: Sequence[Slot], reread: bool = False) -> None:
        """Returns slots to the pool (under the lock). reread: a receiver may still be reading them by
        reference, so their stamps are cleared first (such a read then fails, kv_transfer/shm.py)."""
        for slot in slots:
            if reread and self.shm is not None and slot.offset >= 0:
                self.shm.clear(slot.offset + HEADER_BYTES)
            self.staging.release(slot)
        self._slot_freed.notify_all()

    def _give_back_held(self, out: Outbound, rank: int | None = None) -> None:
        """Returns the shared slots out holds for destination rank (None: every rank). Those of a rank that
        acknowledged OK were read; any others may still be (reread)."""
        ranks = list(out.held) if rank is None else [rank]
        for r in ranks:
            if slots := out.held.pop(r, ()):
                self._give_back(slots, reread=r not in out.acked)

    # -- both sides ----------------------------------------------------------------------------------------

    def listen_address(self) -> str:
        return self.transport.address

    def abort(self, transfer_id: str, reason: str = "aborted", expired: bool = False) -> None:
        """Ends the transfer on this rank as ABORTED (or EXPIRED) unless it already ended, and tells the peers.
        Once this returns, nothing more is written into the transfer's destination blocks here."""
        key = transfer_key(transfer_id)
        state = TransferState.EXPIRED if expired else TransferState.ABORTED
        with self._lock:
            if (inbound := self._in.get(key)) is not None and inbound.end(state, reason):
                self.replies.tell_senders(key, inbound)
            if (out := self._out.get(key)) is not None and out.end(state, reason):
                self.replies.tell_receivers(key, out)

    def poll(self, transfer_ids: Sequence[str] | None = None) -> dict[str, RankStatus]:
        """Each transfer's state on this rank (all of them when transfer_ids is None; unknown ids are left
        out). Never blocks on the network."""
        with self._lock:
            transfers = [*self._in.values(), *self._out.values()]
            wanted = None if transfer_ids is None else set(transfer_ids)
            return {t.transfer_id: RankStatus(t.state, t.nbytes, t.error) for t in transfers
                    if wanted is None or t.transfer_id in wanted}

    def release(self, transfer_id: str) -> None:
        """Forgets an ended transfer (aborting it first if it is still running); late messages for it are then
        answered with its outcome for tombstone_s (receiving side: to the senders it was expected from)."""
        key = transfer_key(transfer_id)
        self.abort(transfer_id, "released")
        with self._lock:
            for table in (self._in, self._out):
                if (t := table.pop(key, None)) is not None:
                    inbound = isinstance(t, Inbound)
                    self._tombstones[key] = Tombstone(STATUS_FOR[t.state], self.clock(),
                                                      t.senders if inbound else (), t.max_message if inbound else 0)
                    if not inbound:
                        now = time.monotonic()  # their slots come back when UCX is done with them
                        self._orphans.extend((h, slot, peer, now) for h, slot, peer in t.pending)
                        self._give_back_held(t)
                        if readers := t.store_readers - t.answered:
                            self._store_readers[key] = (readers, self.clock())

    def store_reads_pending(self, transfer_ids: Sequence[str]) -> set[str]:
        """Those of transfer_ids whose refs into this rank's KV store a destination rank may still read: sent to
        it, and no ACK from it since (an ACK of any status means it reads nothing more of the transfer)."""
        with self._lock:
            pending = set()
            for transfer_id in transfer_ids:
                key = transfer_key(transfer_id)
                out = self._out.get(key)
                if key in self._store_readers or (out is not None and out.store_readers - out.answered):
                    pending.add(transfer_id)
            return pending

    def source_blocks(self, transfer_id: str) -> tuple[int, ...]:
        """The source blocks an armed transfer sends from (empty before its first send; tests, debugging)."""
        with self._lock:
            out = self._out.get(transfer_key(transfer_id))
            return out.source_blocks if out else ()

    def read_kv(self, block_ids: Sequence[int]) -> np.ndarray:
        """A float32 host copy of this rank's K/V of block_ids: [layers, 2, blocks, KV heads, block_size,
        head_dim] (tests)."""
        return self.copier.read(block_ids)

    def stats(self) -> AgentStats:
        with self._lock:
            return AgentStats(len(self._in), len(self._out), self.staging.num_in_use, self.staging.free_bytes,
                              self.one_off_buffers, str(self.copier.device), self.path, self.drops.snapshot(),
                              self.shared_memory, self.by_reference, self.from_store)

    def check_integrity(self) -> None:
        """Raises ValueError if a staging slot is held with nothing in flight."""
        with self._lock:
            in_flight = self.inbox.slots_in_flight + sum(
                1 for _, s, _, _ in self._orphans if s is not None and s.offset >= 0) + sum(
                1 for o in self._out.values() for _, s, _ in o.pending if s is not None and s.offset >= 0) + sum(
                len(held) for o in self._out.values() for held in o.held.values())
            if in_flight != self.staging.num_in_use:
                raise ValueError(f"{self.staging.num_in_use} staging slots held, {in_flight} messages in flight")
            self.staging.check_integrity()

    def drop_connections(self, reason: str = "the connection dropped") -> int:
        """What a network drop does to this rank, for failure drills (ReplicaShell.inject_fault): every
        outbound transfer still running fails (its receivers are told, over a new connection) and every
        connection this agent opened is closed. Returns how many transfers failed."""
        with self._lock:
            for peer in {peer for out in self._out.values() for peer in out.descriptor.addresses}:
                self.transport.forget_peer(peer)  # first: the ABORTs below go over new connections
            failed = 0
            for key, out in self._out.items():
                if out.end(TransferState.FAILED, reason):
                    failed += 1
                    self.replies.tell_receivers(key, out)
        return failed

    def close(self) -> None:
        """Stops the pump and the transport (idempotent). Transfers still running here end with the peers'
        leases."""
        self._stop.set()
        self._pump.join(timeout=5)
        self.transport.close()
        if self.shm is not None:
            self.shm.close()

    # -- the pump ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.copier.bind_thread()  # this thread posts receives into device-side slots
        except Exception as e:  # such receives then fail (and are dropped) instead of the pump
            _log.warning("rank %d: could not make %s current on the transfer thread: %s", self.rank,
                         self.copier.device, e)
        while not self._stop.is_set():
            try:
                busy = self._turn()
                with self._lock:
                    active = bool(self.inbox.busy or self.replies.busy or
                                  any(not t.state.terminal for t in (*self._in.values(), *self._out.values())))
            except Exception as e:  # a bug here, not a peer's message: fail what is running and go on
                _log.exception("rank %d: transfer agent error", self.rank)
                self._fail_everything(f"transfer agent error: {type(e).__name__}: {e}")
                busy = active = False
            if not busy:
                time.sleep(0.0002 if active else self.config.idle_poll_s)

    def _turn(self) -> bool:
        """One pump turn: posts receives for what arrived, checks the finished ones outside the lock (MACs),
        acts on the authentic ones, then finishes sends and checks leases. Returns whether anything moved."""
        with self._lock:
            busy = self.inbox.post(self._room)
            finished = self.inbox.finished()
        opened = [(received, self._open(received)) for received in finished]
        with self._lock:
            for received, message in opened:
                try:
                    if isinstance(message, DataMessage):
                        self._on_data(message)
                    elif isinstance(message, ControlMessage):
                        self._on_control(message)
                except Exception as e:  # ends the one transfer the message authenticated for
                    _log.exception("rank %d: handling a message under tag %#x", self.rank, received.tag)
                    self._fail(message.key, f"transfer agent error: {type(e).__name__}: {e}")
                finally:
                    self.inbox.release(received)
            busy |= bool(finished) | self._finish_sends()
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
        with self._lock:
            for key, t in [*self._in.items(), *self._out.items()]:
                t.end(TransferState.FAILED, reason)

    def _fail(self, key: int, reason: str) -> None:
        if (inbound := self._in.get(key)) is not None and inbound.end(TransferState.FAILED, reason):
            self.replies.tell_senders(key, inbound)
        if (out := self._out.get(key)) is not None and out.end(TransferState.FAILED, reason):
            self.replies.tell_receivers(key, out)

    def _room(self, key: int) -> int | None:
        """The most bytes a DATA message under key may have: what its reservation allows, None for a transfer
        this agent neither holds nor remembers with senders to answer (the Inbox drains those)."""
        if (inbound := self._in.get(key)) is not None:
            return inbound.max_message
        tombstone = self._tombstones.get(key)
        return tombstone.max_message if tombstone is not None and tombstone.max_message else None

    def _on_data(self, message: DataMessage) -> None:
        key, header, index, slot = message.key, message.header, message.index, message.slot
        inbound = self._in.get(key)
        if inbound is None or inbound.state.terminal:
            self._answer_late(key, inbound, header.src_rank)
            return
        inbound.seen.add(header.src_rank)
        sent = self.format.with_dtype(header.kv_dtype)  # what the payload holds: this store's format, or a peer's
        problem = inbound.problem_with(header, index, self.layers, self.kv_heads, sent.bytes_per_block_layer_head)
        if problem is not None:
            inbound.end(TransferState.FAILED, problem[1])
            self.replies.tell_senders(key, inbound, problem[0])
            return
        blocks = [inbound.block_ids[b] for b in header.blocks]
        if header.ref is not None:
            if (problem := self._scatter_by_reference(header, blocks)) is not None:
                inbound.end(TransferState.FAILED, problem)
                self.replies.tell_senders(key, inbound, Status.BAD_MESSAGE)
                return
        else:
            end = HEADER_BYTES + header.payload_bytes
            source = slot.view[HEADER_BYTES:end] if slot.device is None else slot.device[HEADER_BYTES:end]
            self._scatter(source, header, blocks)
        if inbound.state is TransferState.RESERVED:
            inbound.state = TransferState.TRANSFERRING
        inbound.arrived.add(index)
        inbound.nbytes += header.payload_bytes
        inbound.expected = header.msgs_for_dst
        if len(inbound.arrived) == inbound.expected:
            inbound.state = TransferState.DONE
            self.replies.tell_senders(key, inbound, Status.OK)

    def _scatter_by_reference(self, header: DataHeader, blocks: list[int]) -> str | None:
        """Copies the payload header.ref names from the sender's shared staging into blocks; the reason it
        could not (the segment cannot be read as named, or the sender reused the slot during the copy)."""
        ref = header.ref
        try:
            if ref.in_store:  # the sender's KV blocks themselves, held there until this transfer ends
                sent = self.format.with_dtype(header.kv_dtype)
                dtype = KV_STORAGE[sent.dtype]
                rows, head_dim = sent.rows_per_block, sent.head_dim
                inner = len(header.kv_heads) * rows * head_dim * dtype.itemsize
                raw = self.peer_segments.store_slice(ref, (len(header.layers), 2, len(header.blocks), inner))
                source = readable(raw).view(dtype).unflatten(3, (len(header.kv_heads), rows, head_dim))
                if sent.dtype == self.format.dtype:
                    self.copier.scatter_slice(source, header.layers, header.kv_heads, blocks)
                else:
                    self.copier.scatter_converted(source, dtype, sent.block_size, header.layers, header.kv_heads,
                                                  blocks)
                return None
            self._scatter(readable(self.peer_segments.view(ref)), header, blocks)
            if not self.peer_segments.still_valid(ref):
                return f"message {header.index}: the sender took its slot back while this rank read it"
        except ShmUnavailable as e:
            return f"message {header.index}: {e}"
        return None

    def _scatter(self, payload, header: DataHeader, blocks: list[int]) -> None:
        """A message's payload bytes into blocks: as they are, or converted from the sender's dtype."""
        if header.kv_dtype == self.format.dtype:
            self.copier.scatter_from(payload, header.layers, header.kv_heads, blocks)
        else:
            self.copier.scatter_converted(payload, KV_STORAGE[header.kv_dtype], self.format.block_size, header.layers,
                                          header.kv_heads, blocks)

    def _answer_late(self, key: int, inbound: Inbound | None, src_rank: int) -> None:
        """An authentic DATA message of a transfer that ended here: its source rank is told the outcome (a
        transfer that ended DONE cannot take more data: UNKNOWN), if the reservation named its address."""
        if inbound is not None:
            status, senders = STATUS_FOR[inbound.state], inbound.senders
        elif (tombstone := self._tombstones.get(key)) is not None:
            status, senders = tombstone.status, tombstone.senders
        else:
            self.drops.count("unknown_transfer", f"DATA from rank {src_rank} for key {key:#x}, forgotten")
            return
        self.drops.count("late", f"DATA from rank {src_rank} for a transfer that ended {status.name}")
        if src_rank < len(senders):
            self.replies.send(senders[src_rank], key, Kind.ACK, status if status is not Status.OK else Status.UNKNOWN)

    def _on_control(self, control: ControlMessage) -> None:
        key, kind, status, rank = control.key, control.kind, control.message.status, control.message.rank
        out, inbound = self._out.get(key), self._in.get(key)
        if kind is Kind.ACK:
            if out is not None:
                out.answered.add(rank)
            if key in self._store_readers:
                readers = self._store_readers[key][0]
                readers.discard(rank)
                if not readers:
                    del self._store_readers[key]
        if kind is Kind.ACK and out is not None and not out.state.terminal:
            if status is Status.OK:
                out.acked.add(rank)
                self._give_back_held(out, rank)
            elif out.end(STATE_FOR[status], f"destination rank {rank} ended the transfer: {status.name.lower()}"):
                self.replies.tell_receivers(key, out)
        elif kind is Kind.ABORT and inbound is not None and not inbound.state.terminal:
            inbound.end(STATE_FOR.get(status, TransferState.FAILED),
                        f"source rank {rank} ended the transfer: {status.name.lower()}")
            self.replies.tell_senders(key, inbound)
        elif (out or inbound) is not None or key in self._tombstones:
            self.drops.count("late", f"{kind.name} {status.name} from rank {rank} for a transfer that ended")
        else:
            self.drops.count("unknown_transfer", f"{kind.name} from rank {rank} for key {key:#x}")

    def _finish_sends(self) -> bool:
        busy = False
        self.replies.prune()
        now = time.monotonic()
        for orphan in list(self._orphans):
            handle, slot, peer, since = orphan
            if handle.done():
                self._orphans.remove(orphan)
                if slot is not None:
                    self._give_back([slot])
            elif now - since > ORPHAN_GRACE_S:
                self.transport.forget_peer(peer)
        for key, out in self._out.items():
            still = []
            for handle, slot, peer in out.pending:
                if not handle.done():
                    still.append((handle, slot, peer))
                    continue
                busy = True
                if slot is not None:
                    self._give_back([slot])
                if (error := handle.error()) is not None:
                    # The connection is broken: close it first, so the ABORT below goes over a new one (closed
                    # after it, the ABORT could be cut on the wire and reach the peer garbled).
                    self.transport.forget_peer(peer)
                    if out.end(TransferState.FAILED, f"send failed: {error}"):
                        self.replies.tell_receivers(key, out)
            out.pending = still
            if out.state.terminal and out.held:
                self._give_back_held(out)
            if (not out.state.terminal and not out.pending and len(out.sent) == len(out.messages)
                    and out.acked >= {m.dst_rank for m in out.messages}):
                out.state = TransferState.DONE
        return busy

    def _check_deadlines(self) -> None:
        now = self.clock()
        for key, t in [*self._in.items(), *self._out.items()]:
            if not t.state.terminal and now > t.deadline:
                t.end(TransferState.EXPIRED, f"the lease ran out with the transfer {t.state.value}")
                if isinstance(t, Inbound):
                    self.replies.tell_senders(key, t)
                else:
                    for peer in {peer for _, _, peer in t.pending}:
                        self.transport.forget_peer(peer)  # ends sends stuck on a silent peer (before the ABORT)
                    self.replies.tell_receivers(key, t)
        cutoff = now - self.config.tombstone_s
        self._tombstones = {k: t for k, t in self._tombstones.items() if t.ended_at >= cutoff}
        self._store_readers = {k: r for k, r in self._store_readers.items() if r[1] >= cutoff}
