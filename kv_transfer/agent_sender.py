"""The sending side of one rank's transfer agent (a prefill rank; kv_transfer/agent.py's module doc has the
protocol): the transfers armed here, their messages gathered from the KV store into staging slots (or sent as
a ref into a shared store), sealed and sent as layers are computed, the slots and sends they hold until the
destination ranks acknowledge, and the sends of forgotten transfers still on the wire. The runner's hook and
send_all take the agent's lock for bookkeeping only; every other method runs under it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tandem.engine.kv.kv_cache import PagedKVCache
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.kv_transfer.agent_context import AgentContext
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferState
from tandem.kv_transfer.device_copy import PendingCopy
from tandem.kv_transfer.plan import Message, plan_messages, plan_pieces
from tandem.kv_transfer.rank_transfer import STATE_FOR, STATUS_FOR, Outbound, Tombstone
from tandem.kv_transfer.shm import HEADER_PAGE, SharedSegment
from tandem.kv_transfer.staging import Slot
from tandem.kv_transfer.wire import HEADER_BYTES, DataHeader, Kind, ShmRef, Status, make_tag, transfer_key

ORPHAN_GRACE_S = 5.0


@dataclass
class _Gathered:
    """A message whose copy into its staging slot has started (not necessarily finished)."""

    message: Message
    slot: Slot
    copy: PendingCopy


class AgentSender:
    def __init__(self, ctx: AgentContext, kv_cache: PagedKVCache, layout: ReplicaLayout):
        self.ctx = ctx
        self.kv = kv_cache
        self.layout = layout
        # The KV store itself in shared memory (AgentFactory.share_kv_store): same-host receivers read from it.
        owner = kv_cache.memory_owner
        self.store_segment = owner if isinstance(owner, SharedSegment) and ctx.shm is not None else None
        self.outbound: dict[int, Outbound] = {}
        self.one_off_buffers = 0  # sends that found the staging pool full
        self.by_reference = self.from_store = 0
        self.bytes_sent = 0  # KV payload bytes of the DATA messages sent (by reference or not)
        # Released transfers whose refs into the KV store some destination ranks may still read: key -> (those
        # ranks, released at). A rank's ACK (any status) says it is done with them: it reads nothing after it.
        self.store_readers: dict[int, tuple[set[int], float]] = {}
        # Sends of released transfers still on the wire: (handle, slot, peer, released at). One not done within
        # ORPHAN_GRACE_S has a silent or dead peer: its connection is closed, which ends it.
        self.orphans: list[tuple[object, Slot, str, float]] = []

    def arm(self, descriptor: TransferDescriptor, seq_id: str | None) -> None:
        """Prepares this rank's messages (see KVTransferAgent.arm; the agent checks the id is free on both sides,
        under its lock). Raises ValueError if the KV formats differ in anything but the dtype."""
        ctx = self.ctx
        ctx.format.check_matches(descriptor.kv, dtype=False)
        pieces = plan_pieces(self.layout, descriptor.layout)
        group = ctx.config.layer_group if seq_id is not None else self.layout.num_layers
        messages = plan_messages(pieces, len(descriptor.block_ids), layer_group=group,
                                 max_message_bytes=ctx.config.max_message_bytes,
                                 bytes_per_block_layer_head=ctx.format.bytes_per_block_layer_head)
        counts: dict[int, int] = {}
        for m in messages:
            counts[m.dst_rank] = counts.get(m.dst_rank, 0) + 1
        mine = tuple(m for m in messages if m.src_rank == ctx.rank)
        out = Outbound(descriptor.transfer_id, descriptor.deadline, descriptor=descriptor, seq_id=seq_id,
                       messages=mine, counts=counts)
        if not mine:
            out.state = TransferState.DONE  # another replica of this rank's KV heads feeds every destination
        self.outbound[transfer_key(descriptor.transfer_id)] = out

    def send(self, out: Outbound, messages: list[Message], block_ids: Sequence[int], wait: bool = False) -> None:
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
        ctx = self.ctx
        slot = self._slot(HEADER_BYTES + m.nbytes(ctx.format.bytes_per_block_layer_head), waiting)
        rows = [block_ids[b] for b in m.blocks]
        device_payload = None if slot.device is None else slot.device[HEADER_BYTES:]
        try:
            copy = ctx.copier.gather_into(slot.view[HEADER_BYTES:], m.layers, m.kv_heads, rows, device_payload)
        except BaseException:
            with ctx.lock:
                self.give_back([slot])
            raise
        return _Gathered(m, slot, copy)

    def _post(self, out: Outbound, g: _Gathered) -> bool:
        """Waits for g's copy, seals it (header and MAC) and sends it. False (and nothing sent, or the send left
        to finish as an orphan) once the transfer has ended or was released."""
        ctx = self.ctx
        try:
            g.copy.wait()
            if out.state.terminal:
                self._drop(g)
                return False
            m, slot = g.message, g.slot
            key = transfer_key(out.descriptor.transfer_id)
            nbytes = m.nbytes(ctx.format.bytes_per_block_layer_head)
            tag = make_tag(key, Kind.DATA, m.index)
            by_reference = (ctx.shm is not None and slot.offset >= 0 and
                            out.descriptor.shm_domain(m.dst_rank) == ctx.shm_domain)
            ref = ctx.shm.ref(slot.offset + HEADER_BYTES, nbytes) if by_reference else None
            header = DataHeader(m.index, out.counts[m.dst_rank], ctx.rank, m.layers, m.kv_heads, m.blocks, nbytes,
                                ref, ctx.format.dtype)
            sealed = np.frombuffer(header.seal(ctx.key, tag, slot.view[HEADER_BYTES:]), dtype=np.uint8)
            if by_reference:  # the header and the ref go; the payload stays in the slot for the receiver
                wire = np.concatenate([sealed, np.frombuffer(ref.pack(), dtype=np.uint8)])
            else:
                slot.view[:HEADER_BYTES] = sealed
                if slot.device is not None:
                    ctx.copier.to_device(slot.view[:HEADER_BYTES], slot.device[:HEADER_BYTES])
                wire = slot.wire
            peer = out.descriptor.addresses[m.dst_rank]
            handle = ctx.transport.send(peer, tag, wire)
        except BaseException:
            self._drop(g)
            raise
        return self._record(out, key, m, handle, peer, nbytes, slot, by_reference)

    def _record(self, out: Outbound, key: int, m: Message, handle, peer: str, nbytes: int, slot: Slot | None,
                by_reference: bool) -> bool:
        """Books a message just sent (from slot, None: from the KV store); False if the transfer was released
        meanwhile (the send is left to finish as an orphan)."""
        pending = None if by_reference else slot
        with self.ctx.lock:
            if self.outbound.get(key) is not out:  # released while this message was gathered
                if by_reference and slot is not None:
                    self.give_back([slot], reread=True)
                self.orphans.append((handle, pending, peer, time.monotonic()))
                return False
            out.sent.add(m.index)
            out.pending.append((handle, pending, peer))
            if by_reference:
                if slot is not None:
                    out.held.setdefault(m.dst_rank, []).append(slot)
                self.by_reference += 1
            out.nbytes += nbytes
            self.bytes_sent += nbytes
            if out.state is TransferState.RESERVED:
                out.state = TransferState.TRANSFERRING
        return True

    def _send_from_store(self, out: Outbound, m: Message, block_ids: Sequence[int]) -> bool:
        """Sends m as a ref into this rank's shared KV store (no copy here: the receiver reads the blocks) where
        the store is shared, the destination rank is in this domain and m's source blocks are one run; False
        (nothing sent) otherwise."""
        ctx = self.ctx
        if self.store_segment is None or out.descriptor.shm_domain(m.dst_rank) != ctx.shm_domain:
            return False
        rows = [block_ids[b] for b in m.blocks]
        if rows != list(range(rows[0], rows[0] + len(rows))) or rows[0] < 0 or rows[-1] >= self.kv.data.shape[2]:
            return False
        data = self.kv.data
        start = data[m.layers.start - ctx.layers.start, 0, rows[0], m.kv_heads.start - ctx.kv_heads.start]
        size = data.element_size()
        key = transfer_key(out.descriptor.transfer_id)
        nbytes = m.nbytes(ctx.format.bytes_per_block_layer_head)
        ref = ShmRef(self.store_segment.pid, self.store_segment.fd, self.store_segment.nonce,
                     HEADER_PAGE + start.data_ptr() - data.data_ptr(), nbytes, 0,
                     tuple(stride * size for stride in data.stride()[:3]))
        tag = make_tag(key, Kind.DATA, m.index)
        header = DataHeader(m.index, out.counts[m.dst_rank], ctx.rank, m.layers, m.kv_heads, m.blocks, nbytes, ref,
                            ctx.format.dtype)
        wire = np.frombuffer(header.seal(ctx.key, tag, b"") + ref.pack(), dtype=np.uint8)
        peer = out.descriptor.addresses[m.dst_rank]
        if self._record(out, key, m, ctx.transport.send(peer, tag, wire), peer, nbytes, None, True):
            with ctx.lock:
                self.from_store += 1
                out.store_readers.add(m.dst_rank)
        return True

    def _drop(self, g: _Gathered) -> None:
        """Gives back the slot of a message that will not be sent, once its copy no longer writes into it."""
        g.copy.wait()
        with self.ctx.lock:
            self.give_back([g.slot])

    def _slot(self, nbytes: int, waiting: Outbound | None = None) -> Slot:
        """A staging slot, else a one-off buffer (counted). With `waiting` and shared staging, a full pool is
        waited on for up to config.room_wait_s, unless that transfer already holds half the pool itself (its
        own slots come back only with its ACK) or already waited in vain once."""
        ctx = self.ctx
        with ctx.lock:
            slot = ctx.staging.acquire(nbytes)
            held = sum(s.size for slots in waiting.held.values() for s in slots) if waiting is not None else 0
            if (slot is None and waiting is not None and ctx.shm is not None and not waiting.waited_in_vain and
                    held + nbytes <= ctx.staging.capacity // 2):
                deadline = time.monotonic() + ctx.config.room_wait_s
                while slot is None and (left := deadline - time.monotonic()) > 0:
                    ctx.slot_freed.wait(min(left, 0.01))
                    slot = ctx.staging.acquire(nbytes)
                waiting.waited_in_vain = slot is None
            if slot is None:
                self.one_off_buffers += 1
                slot = ctx.staging.one_off(nbytes)
            return slot

    def give_back(self, slots: Sequence[Slot], reread: bool = False) -> None:
        """Returns slots to the pool (under the lock). reread: a receiver may still be reading them by
        reference, so their stamps are cleared first (such a read then fails, kv_transfer/shm.py)."""
        ctx = self.ctx
        for slot in slots:
            if reread and ctx.shm is not None and slot.offset >= 0:
                ctx.shm.clear(slot.offset + HEADER_BYTES)
            ctx.staging.release(slot)
        ctx.slot_freed.notify_all()

    def _give_back_held(self, out: Outbound, rank: int | None = None) -> None:
        """Returns the shared slots out holds for destination rank (None: every rank). Those of a rank that
        acknowledged OK were read; any others may still be (reread)."""
        ranks = list(out.held) if rank is None else [rank]
        for r in ranks:
            if slots := out.held.pop(r, ()):
                self.give_back(slots, reread=r not in out.acked)

    # -- under the agent's lock ----------------------------------------------------------------------------

    def end(self, key: int, state: TransferState, reason: str) -> None:
        """Ends the transfer under key (if armed and running) and tells its destination ranks."""
        if (out := self.outbound.get(key)) is not None and out.end(state, reason):
            self.ctx.replies.tell_receivers(key, out)

    def forget(self, key: int) -> None:
        """Drops an ended transfer: a tombstone answers late messages; sends still on the wire finish as
        orphans; the refs into the store a destination rank may still read are remembered."""
        if (t := self.outbound.pop(key, None)) is None:
            return
        self.ctx.tombstones[key] = Tombstone(STATUS_FOR[t.state], self.ctx.clock(), (), 0)
        now = time.monotonic()  # their slots come back when UCX is done with them
        self.orphans.extend((h, slot, peer, now) for h, slot, peer in t.pending)
        self._give_back_held(t)
        if readers := t.store_readers - t.answered:
            self.store_readers[key] = (readers, self.ctx.clock())

    def on_ack(self, key: int, status: Status, rank: int) -> bool:
        """A destination rank's ACK; False if no running transfer took it (the refs it may have read are
        released either way)."""
        out = self.outbound.get(key)
        if out is not None:
            out.answered.add(rank)
        if key in self.store_readers:
            readers = self.store_readers[key][0]
            readers.discard(rank)
            if not readers:
                del self.store_readers[key]
        if out is None or out.state.terminal:
            return False
        if status is Status.OK:
            out.acked.add(rank)
            self._give_back_held(out, rank)
        elif out.end(STATE_FOR[status], f"destination rank {rank} ended the transfer: {status.name.lower()}"):
            self.ctx.replies.tell_receivers(key, out)
        return True

    def reads_pending(self, key: int) -> bool:
        out = self.outbound.get(key)
        return key in self.store_readers or (out is not None and bool(out.store_readers - out.answered))

    def drop_connections(self, reason: str) -> int:
        """Every running transfer fails (its receivers told over new connections) and every connection to a
        destination is closed. Returns how many failed."""
        ctx = self.ctx
        for peer in {peer for out in self.outbound.values() for peer in out.descriptor.addresses}:
            ctx.transport.forget_peer(peer)  # first: the ABORTs below go over new connections
        failed = 0
        for key, out in self.outbound.items():
            if out.end(TransferState.FAILED, reason):
                failed += 1
                ctx.replies.tell_receivers(key, out)
        return failed

    def slots_in_flight(self) -> int:
        """Staging slots this side holds: sends on the wire (orphans included) and slots held for ACKs."""
        return sum(1 for _, s, _, _ in self.orphans if s is not None and s.offset >= 0) + sum(
            1 for o in self.outbound.values() for _, s, _ in o.pending if s is not None and s.offset >= 0) + sum(
            len(held) for o in self.outbound.values() for held in o.held.values())

    def finish_sends(self) -> bool:
        """Books sends the transport finished: slots back, failed sends fail their transfer, a transfer whose
        messages all went and every destination acknowledged is DONE. Returns whether anything moved."""
        ctx = self.ctx
        busy = False
        now = time.monotonic()
        for orphan in list(self.orphans):
            handle, slot, peer, since = orphan
            if handle.done():
                self.orphans.remove(orphan)
                if slot is not None:
                    self.give_back([slot])
            elif now - since > ORPHAN_GRACE_S:
                ctx.transport.forget_peer(peer, handle)
        for key, out in self.outbound.items():
            still = []
            for handle, slot, peer in out.pending:
                if not handle.done():
                    still.append((handle, slot, peer))
                    continue
                busy = True
                if slot is not None:
                    self.give_back([slot])
                if (error := handle.error()) is not None:
                    # The connection is broken: close it first, so the ABORT below goes over a new one. Only
                    # that connection: a newer one (opened for an earlier ABORT) must carry its ABORT out.
                    ctx.transport.forget_peer(peer, handle)
                    if out.end(TransferState.FAILED, f"send failed: {error}"):
                        ctx.replies.tell_receivers(key, out)
            out.pending = still
            if out.state.terminal and out.held:
                self._give_back_held(out)
            if not out.state.terminal and not out.pending and len(out.sent) == len(out.messages):
                if not out.announced:  # "all sent" to every destination rank: a lost message then fails at once
                    out.announced = True
                    for address in out.descriptor.addresses:
                        ctx.replies.send(address, key, Kind.ACK, Status.OK)
                if out.acked >= {m.dst_rank for m in out.messages}:
                    out.state = TransferState.DONE
        return busy

    def expire(self, now: float) -> None:
        ctx = self.ctx
        for key, out in self.outbound.items():
            if not out.state.terminal and now > out.deadline:
                out.end(TransferState.EXPIRED, f"the lease ran out with the transfer {out.state.value}")
                for peer in {peer for _, _, peer in out.pending}:
                    ctx.transport.forget_peer(peer)  # ends sends stuck on a silent peer (before the ABORT)
                ctx.replies.tell_receivers(key, out)
        cutoff = now - ctx.config.tombstone_s
        self.store_readers = {k: r for k, r in self.store_readers.items() if r[1] >= cutoff}
