"""The transfer agent of one rank: it lives beside that rank's KV store (in the rank's process) and moves its
share of each request's KV.

Receiving (decode rank): expect() registers the request's destination blocks and lease. A pump thread probes
for DATA messages of any transfer, receives each into a staging slot, checks its header and checksum, copies
the payload into the KV blocks and, once the header's message count has arrived, acknowledges every sender
(ACK OK). A bad checksum, a broken connection, the lease passing, or an ABORT from the sender end the transfer
in FAILED / EXPIRED / ABORTED, and each sender seen is told. Messages of a transfer the agent does not hold
(never reserved, ended, forgotten) are drained and answered with that transfer's outcome, so no sender waits
on them.

Sending (prefill rank): arm() computes the plan's messages for this rank. The model runner calls
on_layers_done() after each layer; every message whose last layer that is leaves at once (gathered from the
KV store into a staging slot, checksummed, sent without blocking), so sending overlaps the next layers'
compute. send_all() sends everything at once (KV already computed). Within one call the copy of message i+1
is started before message i is checksummed and sent (on a GPU the two overlap; on the CPU the copy is
synchronous). The transfer is DONE when every destination rank it feeds has acknowledged; a failed send, a
negative acknowledgement or the lease passing end it otherwise, and its destination ranks are told (ABORT).

Devices: the KV store lives on the CPU or a CUDA device; a KVCopier (device_copy.py) does every copy between it
and the staging slots, so this file is the same for both. The path, chosen once: "staged" (host slots, pinned
beside a CUDA store) or "direct" (device-side slots the transport sends and receives as they are; their host
mirror carries the header and the checksum). See TransferConfig.kv_path; stats() reports it.

Threads: the driver's calls (expect, arm, abort, poll, release) and the runner's hook take the agent's lock
for bookkeeping only; copies and checksums run outside it, except the copy into KV blocks, which holds the lock
so that abort() returning means no more writes into those blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from tandem.engine.kv_cache import PagedKVCache
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat, RankStatus, TransferDescriptor, TransferState
from tandem.kv_transfer.device_copy import KVCopier, PendingCopy
from tandem.kv_transfer.plan import Message, plan_messages, plan_pieces
from tandem.kv_transfer.rank_transfer import STATE_FOR, STATUS_FOR, Inbound, Outbound
from tandem.kv_transfer.staging import Slot, StagingPool
from tandem.kv_transfer.transport import Transport
from tandem.kv_transfer.wire import (HEADER_BYTES, KIND_MASK, STATUS_BYTES, DataHeader, Kind, Status, checksum,
                                     make_tag, pack_status, split_tag, transfer_key, unpack_status)

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
                               str(spec.dtype).removeprefix("torch."))
        if len(transport.address.encode()) > 64:
            raise ValueError(f"transfer address {transport.address!r} is longer than the 64 bytes a header holds")
        self.copier = KVCopier(kv_cache.data, self.layers, self.kv_heads)
        self.path = self._choose_path(config.kv_path)
        self.staging = StagingPool(config.staging_bytes, self.copier.host_buffer,
                                   self.copier.device_buffer if self.path == "direct" else None)
        self.one_off_buffers = 0
        self._lock = threading.RLock()
        self._in: dict[int, Inbound] = {}
        self._out: dict[int, Outbound] = {}
        self._tombstones: dict[int, tuple[Status, float]] = {}
        self._receiving: list[tuple[object, Slot, int]] = []  # (handle, slot, tag)
        self._control: list[tuple[object, np.ndarray]] = []  # small sends kept alive until done
        # Sends of released transfers still on the wire: (handle, slot, peer, released at). One not done within
        # ORPHAN_GRACE_S has a silent or dead peer: its connection is closed, which ends it.
        self._orphans: list[tuple[object, Slot, str, float]] = []
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._run, name=f"kv-agent-{rank}", daemon=True)
        self._pump.start()

    @property
    def address(self) -> str:
        return self.transport.address

    def _choose_path(self, wanted: str) -> str:
        """"staged" or "direct" for config.kv_path `wanted` (see TransferConfig), logged once. Raises
        ValueError for "direct" beside a CUDA store when the transport cannot move device memory."""
        device = self.copier.device
        carriers = self.transport.device_transports if self.copier.on_cuda else ()
        if wanted == "direct" and self.copier.on_cuda and not carriers:
            raise ValueError(f"kv_path='direct' needs a transport that moves CUDA memory between processes; "
                             f"this one reports none (UCX: no cuda_ipc, no RDMA with GPUDirect here). "
                             f"Use kv_path='staged' or 'auto'")
        path = "direct" if wanted == "direct" or (wanted == "auto" and carriers) else "staged"
        _log.info("rank %d: KV store on %s, %s transfers (device transports: %s)", self.rank, device, path,
                  ", ".join(carriers) or "none")
        return path

    # -- receiving side ------------------------------------------------------------------------------------

    def expect(self, transfer_id: str, block_ids: Sequence[int], deadline: float) -> None:
        """Registers destination blocks (block ids of this rank's store, in token order) for a transfer.
        Raises ValueError for a transfer id already held or block ids that repeat."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"transfer {transfer_id!r}: destination block ids repeat: {list(block_ids)}")
        key = transfer_key(transfer_id)
        with self._lock:
            if key in self._in or key in self._out:
                raise ValueError(f"transfer {transfer_id!r} is already registered on rank {self.rank}")
            self._tombstones.pop(key, None)
            self._in[key] = Inbound(transfer_id, deadline, block_ids=tuple(block_ids))

    # -- sending side --------------------------------------------------------------------------------------

    def arm(self, descriptor: TransferDescriptor, seq_id: str | None = None) -> None:
        """Prepares this rank's messages for descriptor. With seq_id, on_layers_done sends them as the
        sequence's layers are computed, config.layer_group layers a message; without, call send_all, which
        sends all layers of a piece together (the fewest, largest messages). Raises ValueError if the KV formats
        differ or the transfer id is in use here."""
        self.format.check_matches(descriptor.kv)
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
        self._send_messages(out, [m for m in out.messages if m.index not in out.sent], block_ids)

    def _send_messages(self, out: Outbound, messages: list[Message], block_ids: Sequence[int]) -> None:
        """Gathers and sends messages in order, one copy ahead: message i+1's copy is started before message
        i is checksummed and sent. Stops at a terminal state or a release; a copy started and not sent gives
        its slot back."""
        out.source_blocks = tuple(block_ids)
        ahead: _Gathered | None = None
        try:
            for m in messages:
                if out.state.terminal:
                    break
                current, ahead = ahead, self._gather(m, block_ids)
                if current is not None and not self._post(out, current):
                    break
            else:
                if ahead is not None:
                    current, ahead = ahead, None
                    self._post(out, current)
        finally:
            if ahead is not None:
                self._drop(ahead)

    def _gather(self, m: Message, block_ids: Sequence[int]) -> _Gathered:
        """Takes a slot for m and starts copying m's slice of the KV store into it."""
        slot = self._slot(HEADER_BYTES + m.nbytes(self.format.bytes_per_block_layer_head))
        rows = [block_ids[b] for b in m.blocks]
        device_payload = None if slot.device is None else slot.device[HEADER_BYTES:]
        try:
            copy = self.copier.gather_into(slot.view[HEADER_BYTES:], m.layers, m.kv_heads, rows, device_payload)
        except BaseException:
            with self._lock:
                self.staging.release(slot)
            raise
        return _Gathered(m, slot, copy)

    def _post(self, out: Outbound, g: _Gathered) -> bool:
        """Waits for g's copy, checksums it and sends it. False (and nothing sent, or the send left to finish
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
            header = DataHeader(m.index, out.counts[m.dst_rank], self.rank, m.layers, m.kv_heads, m.blocks, nbytes,
                                checksum(slot.view[HEADER_BYTES:], tag), self.address)
            slot.view[:HEADER_BYTES] = np.frombuffer(header.pack(), dtype=np.uint8)
            if slot.device is not None:
                self.copier.to_device(slot.view[:HEADER_BYTES], slot.device[:HEADER_BYTES])
            peer = out.descriptor.addresses[m.dst_rank]
            handle = self.transport.send(peer, tag, slot.wire)
        except BaseException:
            self._drop(g)
            raise
        with self._lock:
            if self._out.get(key) is not out:  # released while this message was gathered
                self._orphans.append((handle, slot, peer, time.monotonic()))
                return False
            out.sent.add(m.index)
            out.pending.append((handle, slot, peer))
            out.nbytes += nbytes
            if out.state is TransferState.RESERVED:
                out.state = TransferState.TRANSFERRING
        return True

    def _drop(self, g: _Gathered) -> None:
        """Gives back the slot of a message that will not be sent, once its copy no longer writes into it."""
        g.copy.wait()
        with self._lock:
            self.staging.release(g.slot)

    def _slot(self, nbytes: int) -> Slot:
        with self._lock:
            slot = self.staging.acquire(nbytes)
            if slot is None:
                self.one_off_buffers += 1
                slot = self.staging.one_off(nbytes)
            return slot

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
                self._notify_senders(key, inbound)
            if (out := self._out.get(key)) is not None and out.end(state, reason):
                self._notify_receivers(key, out)

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
        answered with its outcome for tombstone_s."""
        key = transfer_key(transfer_id)
        self.abort(transfer_id, "released")
        with self._lock:
            for table in (self._in, self._out):
                if (t := table.pop(key, None)) is not None:
                    self._tombstones[key] = (STATUS_FOR[t.state], self.clock())
                    if isinstance(t, Outbound):
                        now = time.monotonic()  # their slots come back when UCX is done with them
                        self._orphans.extend((h, slot, peer, now) for h, slot, peer in t.pending)

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
                              self.one_off_buffers, str(self.copier.device), self.path)

    def check_integrity(self) -> None:
        """Raises ValueError if a staging slot is held with nothing in flight."""
        with self._lock:
            in_flight = sum(1 for _, s, _ in self._receiving if s.offset >= 0) + sum(
                1 for _, s, _, _ in self._orphans if s.offset >= 0) + sum(
                1 for o in self._out.values() for _, s, _ in o.pending if s.offset >= 0)
            if in_flight != self.staging.num_in_use:
                raise ValueError(f"{self.staging.num_in_use} staging slots held, {in_flight} messages in flight")
            self.staging.check_integrity()

    def close(self) -> None:
        """Stops the pump and the transport (idempotent). Transfers still running here end with the peers'
        leases."""
        self._stop.set()
        self._pump.join(timeout=5)
        self.transport.close()

    # -- the pump ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.copier.bind_thread()  # this thread posts receives into device-side slots
        except Exception as e:  # such receives then fail (and end their transfers) instead of the pump
            _log.warning("rank %d: could not make %s current on the transfer thread: %s", self.rank,
                         self.copier.device, e)
        while not self._stop.is_set():
            busy = False
            try:
                with self._lock:
                    busy |= self._take_data()
                    busy |= self._take_control()
                    busy |= self._finish_receives()
                    busy |= self._finish_sends()
                    self._check_deadlines()
                    active = bool(self._receiving or self._control or
                                  any(not t.state.terminal for t in (*self._in.values(), *self._out.values())))
            except Exception as e:  # never let the pump die silently: fail what is running and go on
                self._fail_everything(f"transfer agent error: {type(e).__name__}: {e}")
                active = False
            if not busy:
                time.sleep(0.0002 if active else self.config.idle_poll_s)

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            for key, t in [*self._in.items(), *self._out.items()]:
                t.end(TransferState.FAILED, reason)

    def _take_data(self) -> bool:
        """Posts a receive for every arrived DATA message while staging has room (oldest first)."""
        taken = False
        while (probe := self.transport.probe(make_tag(0, Kind.DATA, 0), KIND_MASK)) is not None:
            key = probe.tag >> 16
            inbound = self._in.get(key)
            if inbound is not None and not inbound.state.terminal:
                slot = self.staging.acquire(probe.length)
                if slot is None:
                    break  # staging full: it waits until a slot frees up
                if inbound.state is TransferState.RESERVED:
                    inbound.state = TransferState.TRANSFERRING
            else:
                slot = Slot(-1, probe.length, np.empty(probe.length, dtype=np.uint8))  # drained, then answered
            self._receiving.append((self.transport.receive(probe, slot.wire), slot, probe.tag))
            taken = True
        return taken

    def _finish_receives(self) -> bool:
        done = [r for r in self._receiving if r[0].done()]
        for item in done:
            self._receiving.remove(item)
            handle, slot, tag = item
            try:
                self._on_data(handle, slot, tag)
            finally:
                self.staging.release(slot)
        return bool(done)

    def _on_data(self, handle, slot: Slot, tag: int) -> None:
        key, _, index = split_tag(tag)
        inbound = self._in.get(key)
        if (error := handle.error()) is not None:
            if inbound is not None and inbound.end(TransferState.FAILED, f"receive failed: {error}"):
                self._notify_senders(key, inbound)
            return
        if slot.device is not None:  # a device-side slot: its header and checksum are read from a host copy
            self.copier.to_host(slot.device, slot.view)
        try:
            header = DataHeader.unpack(slot.view)
        except ValueError as e:
            if inbound is not None and inbound.end(TransferState.FAILED, f"bad message: {e}"):
                self._notify_senders(key, inbound)
            return
        if inbound is None or inbound.state.terminal:
            ended = self._tombstones.get(key, (Status.UNKNOWN, 0.0))[0] if inbound is None else \
                STATUS_FOR[inbound.state]
            self._send_status(header.sender, key, Kind.ACK, ended if ended is not Status.OK else Status.UNKNOWN)
            return
        inbound.senders.add(header.sender)
        payload = slot.view[HEADER_BYTES:HEADER_BYTES + header.payload_bytes]
        problem = inbound.problem_with(header, index, len(slot.view) - HEADER_BYTES, self.layers, self.kv_heads,
                                       self.format.bytes_per_block_layer_head)
        if problem is None and checksum(payload, tag) != header.checksum:
            problem = (Status.CHECKSUM, f"checksum mismatch in message {index} from rank {header.src_rank} "
                                        f"(layers {header.layers.start}-{header.layers.stop - 1})")
        if problem is not None:
            inbound.end(TransferState.FAILED, problem[1])
            self._notify_senders(key, inbound, problem[0])
            return
        source = payload if slot.device is None else slot.device[HEADER_BYTES:HEADER_BYTES + header.payload_bytes]
        self.copier.scatter_from(source, header.layers, header.kv_heads,
                                 [inbound.block_ids[b] for b in header.blocks])
        inbound.arrived.add(index)
        inbound.nbytes += header.payload_bytes
        inbound.expected = header.msgs_for_dst
        if len(inbound.arrived) == inbound.expected:
            inbound.state = TransferState.DONE
            self._notify_senders(key, inbound, Status.OK)

    def _take_control(self) -> bool:
        busy = False
        for kind in (Kind.ACK, Kind.ABORT):
            while (probe := self.transport.probe(make_tag(0, kind, 0), KIND_MASK)) is not None:
                buffer = np.empty(max(probe.length, STATUS_BYTES), dtype=np.uint8)
                handle = self.transport.receive(probe, buffer)
                deadline = time.monotonic() + 5
                while not handle.done() and time.monotonic() < deadline:
                    time.sleep(0.0001)  # a few bytes: eager, done at once
                if handle.done() and handle.error() is None:
                    self._on_control(probe.tag, *unpack_status(buffer))
                busy = True
        return busy

    def _on_control(self, tag: int, status: Status, rank: int, _: int) -> None:
        key, kind, _ = split_tag(tag)
        if kind is Kind.ACK and (out := self._out.get(key)) is not None and not out.state.terminal:
            if status is Status.OK:
                out.acked.add(rank)
            elif out.end(STATE_FOR[status], f"destination rank {rank} ended the transfer: {status.name.lower()}"):
                self._notify_receivers(key, out)
        elif kind is Kind.ABORT and (inbound := self._in.get(key)) is not None:
            if inbound.end(STATE_FOR.get(status, TransferState.FAILED),
                           f"source rank {rank} ended the transfer: {status.name.lower()}"):
                self._notify_senders(key, inbound)

    def _finish_sends(self) -> bool:
        busy = False
        self._control = [(h, b) for h, b in self._control if not h.done()]
        now = time.monotonic()
        for orphan in list(self._orphans):
            handle, slot, peer, since = orphan
            if handle.done():
                self._orphans.remove(orphan)
                self.staging.release(slot)
            elif now - since > ORPHAN_GRACE_S:
                self.transport.forget_peer(peer)
        for key, out in self._out.items():
            still = []
            for handle, slot, peer in out.pending:
                if not handle.done():
                    still.append((handle, slot, peer))
                    continue
                busy = True
                self.staging.release(slot)
                if (error := handle.error()) is not None:
                    if out.end(TransferState.FAILED, f"send failed: {error}"):
                        self._notify_receivers(key, out)
                    self.transport.forget_peer(peer)  # the connection is broken: the next send reconnects
            out.pending = still
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
                    self._notify_senders(key, t)
                else:
                    self._notify_receivers(key, t)
                    for peer in {peer for _, _, peer in t.pending}:
                        self.transport.forget_peer(peer)  # ends sends stuck on a silent peer
        cutoff = now - self.config.tombstone_s
        self._tombstones = {k: v for k, v in self._tombstones.items() if v[1] >= cutoff}

    def _notify_senders(self, key: int, inbound: Inbound, status: Status | None = None) -> None:
        status = STATUS_FOR[inbound.state] if status is None else status
        for sender in inbound.senders:
            self._send_status(sender, key, Kind.ACK, status)

    def _notify_receivers(self, key: int, out: Outbound) -> None:
        for dst in sorted({m.dst_rank for m in out.messages}):
            self._send_status(out.descriptor.addresses[dst], key, Kind.ABORT, STATUS_FOR[out.state])

    def _send_status(self, peer: str, key: int, kind: Kind, status: Status) -> None:
        buffer = np.frombuffer(pack_status(status, self.rank), dtype=np.uint8).copy()
        try:
            self._control.append((self.transport.send(peer, make_tag(key, kind, self.rank), buffer), buffer))
        except Exception:
            pass  # the peer learns the outcome from its own lease instead
