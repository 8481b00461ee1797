"""The receiving side of one rank's transfer agent (a decode rank; kv_transfer/agent.py's module doc has the
protocol): the reservations this rank expects data for, the DATA messages the pump hands it, copied into the
reserved blocks (from the message, or by reference from a same-host sender's shared memory), and the answers
to the senders the reservation named. Every method but expect runs under the agent's lock."""

from __future__ import annotations

from typing import Callable, Sequence

from tandem.engine.kv.kv_cache import KV_STORAGE
from tandem.kv_transfer.agent_context import AgentContext
from tandem.kv_transfer.descriptor import TransferState
from tandem.kv_transfer.inbox import DataMessage
from tandem.kv_transfer.rank_transfer import STATE_FOR, STATUS_FOR, Inbound, Tombstone
from tandem.kv_transfer.shm import PeerSegments, ShmUnavailable, readable
from tandem.kv_transfer.wire import HEADER_BYTES, DataHeader, Kind, Status, transfer_key


SENT_GRACE_S = 0.5  # a transfer whose senders all sent everything and still lacks messages fails this long after


class AgentReceiver:
    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.inbound: dict[int, Inbound] = {}
        self.peer_segments = PeerSegments()
        self.bytes_received = 0  # KV payload bytes of the authentic DATA messages written into blocks

    def expect(self, transfer_id: str, block_ids: Sequence[int], deadline: float, senders: Sequence[str]) -> None:
        """Registers destination blocks (see KVTransferAgent.expect; the agent checks the id is free on both
        sides, under its lock). Raises ValueError for block ids that repeat or senders given as one string."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"transfer {transfer_id!r}: destination block ids repeat: {list(block_ids)}")
        if isinstance(senders, str):
            raise ValueError(f"transfer {transfer_id!r}: senders must be a sequence of addresses, got {senders!r}")
        ctx = self.ctx
        # The sender's dtype is learnt from its messages: room for the widest a peer may send.
        share = len(block_ids) * len(ctx.layers) * len(ctx.kv_heads) * ctx.format.largest_bytes_per_block_layer_head
        key = transfer_key(transfer_id)
        ctx.tombstones.pop(key, None)
        self.inbound[key] = Inbound(transfer_id, deadline, block_ids=tuple(block_ids), senders=tuple(senders),
                                    max_message=HEADER_BYTES + min(ctx.config.max_message_bytes, share))

    def room(self, key: int) -> int | None:
        """The most bytes a DATA message under key may have: what its reservation allows, None for a transfer
        this side neither holds nor remembers with senders to answer (the Inbox drains those)."""
        if (inbound := self.inbound.get(key)) is not None:
            return inbound.max_message
        tombstone = self.ctx.tombstones.get(key)
        return tombstone.max_message if tombstone is not None and tombstone.max_message else None

    def end(self, key: int, state: TransferState, reason: str) -> None:
        """Ends the reservation under key (if held and running) and tells its senders."""
        if (inbound := self.inbound.get(key)) is not None and inbound.end(state, reason):
            self.ctx.replies.tell_senders(key, inbound)

    def forget(self, key: int) -> None:
        """Drops an ended reservation, leaving a tombstone that answers late messages for tombstone_s."""
        if (t := self.inbound.pop(key, None)) is not None:
            self.ctx.tombstones[key] = Tombstone(STATUS_FOR[t.state], self.ctx.clock(), t.senders, t.max_message)

    def on_abort(self, key: int, status: Status, rank: int) -> bool:
        """A source rank's ABORT; False if no running reservation took it."""
        inbound = self.inbound.get(key)
        if inbound is None or inbound.state.terminal:
            return False
        inbound.end(STATE_FOR.get(status, TransferState.FAILED),
                    f"source rank {rank} ended the transfer: {status.name.lower()}")
        self.ctx.replies.tell_senders(key, inbound)
        return True

    def on_sent(self, key: int, status: Status, rank: int) -> bool:
        """A source rank's ACK: it sent this rank every message of the transfer under key (status OK). Noted
        for expire(); False if this rank does not know the transfer (the agent then counts the message)."""
        inbound = self.inbound.get(key)
        if inbound is None:
            return key in self.ctx.tombstones  # the transfer ended here already: nothing to do
        if status is Status.OK and not inbound.state.terminal and 0 <= rank < len(inbound.senders):
            inbound.sent_by.setdefault(rank, self.ctx.clock())
        return True

    def expire(self, now: float, arriving: Callable[[int], bool]) -> None:
        """Ends the reservations whose lease ran out (EXPIRED), and (FAILED, every named sender told BAD_MESSAGE)
        those whose senders all said they sent everything SENT_GRACE_S ago while messages are still missing and
        none is arriving (arriving(key): a DATA message under key is queued or being received): a message lost
        or corrupted on the wire (dropped by its MAC check) fails the transfer at once, not at its lease, so the
        request falls back now. Only authentic messages count: a forged copy of a message changes nothing."""
        for key, inbound in self.inbound.items():
            if inbound.state.terminal:
                continue
            if now > inbound.deadline:
                inbound.end(TransferState.EXPIRED, f"the lease ran out with the transfer {inbound.state.value}")
                self.ctx.replies.tell_senders(key, inbound)
            elif (inbound.senders and len(inbound.sent_by) == len(inbound.senders)
                  and now - max(inbound.sent_by.values()) >= SENT_GRACE_S and not arriving(key)):
                missing = "every message" if inbound.expected is None else \
                    f"{inbound.expected - len(inbound.arrived)} of {inbound.expected} messages"
                inbound.end(TransferState.FAILED, f"every sender sent everything, but {missing} never arrived "
                                                  f"intact (lost, or corrupted and dropped by its MAC check)")
                self.ctx.replies.tell_senders(key, inbound, Status.BAD_MESSAGE, every_named=True)

    def on_data(self, message: DataMessage) -> None:
        ctx = self.ctx
        key, header, index, slot = message.key, message.header, message.index, message.slot
        inbound = self.inbound.get(key)
        if inbound is None or inbound.state.terminal:
            self._answer_late(key, inbound, header.src_rank)
            return
        inbound.seen.add(header.src_rank)
        sent = ctx.format.with_dtype(header.kv_dtype)  # what the payload holds: this store's format, or a peer's
        problem = inbound.problem_with(header, index, ctx.layers, ctx.kv_heads, sent.bytes_per_block_layer_head)
        if problem is not None:
            inbound.end(TransferState.FAILED, problem[1])
            ctx.replies.tell_senders(key, inbound, problem[0])
            return
        blocks = [inbound.block_ids[b] for b in header.blocks]
        if header.ref is not None:
            if (problem := self._scatter_by_reference(header, blocks)) is not None:
                inbound.end(TransferState.FAILED, problem)
                ctx.replies.tell_senders(key, inbound, Status.BAD_MESSAGE)
                return
        else:
            end = HEADER_BYTES + header.payload_bytes
            source = slot.view[HEADER_BYTES:end] if slot.device is None else slot.device[HEADER_BYTES:end]
            self._scatter(source, header, blocks)
        if inbound.state is TransferState.RESERVED:
            inbound.state = TransferState.TRANSFERRING
        inbound.arrived.add(index)
        inbound.nbytes += header.payload_bytes
        self.bytes_received += header.payload_bytes
        inbound.expected = header.msgs_for_dst
        if len(inbound.arrived) == inbound.expected:
            inbound.state = TransferState.DONE
            ctx.replies.tell_senders(key, inbound, Status.OK)

    def _scatter_by_reference(self, header: DataHeader, blocks: list[int]) -> str | None:
        """Copies the payload header.ref names from the sender's shared staging into blocks; the reason it
        could not (the segment cannot be read as named, or the sender reused the slot during the copy)."""
        ref, ctx = header.ref, self.ctx
        try:
            if ref.in_store:  # the sender's KV blocks themselves, held there until this transfer ends
                sent = ctx.format.with_dtype(header.kv_dtype)
                dtype = KV_STORAGE[sent.dtype]
                rows, head_dim = sent.rows_per_block, sent.head_dim
                inner = len(header.kv_heads) * rows * head_dim * dtype.itemsize
                raw = self.peer_segments.store_slice(ref, (len(header.layers), 2, len(header.blocks), inner))
                source = readable(raw).view(dtype).unflatten(3, (len(header.kv_heads), rows, head_dim))
                if sent.dtype == ctx.format.dtype:
                    ctx.copier.scatter_slice(source, header.layers, header.kv_heads, blocks)
                else:
                    ctx.copier.scatter_converted(source, dtype, sent.block_size, header.layers, header.kv_heads,
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
        ctx = self.ctx
        if header.kv_dtype == ctx.format.dtype:
            ctx.copier.scatter_from(payload, header.layers, header.kv_heads, blocks)
        else:
            ctx.copier.scatter_converted(payload, KV_STORAGE[header.kv_dtype], ctx.format.block_size, header.layers,
                                         header.kv_heads, blocks)

    def _answer_late(self, key: int, inbound: Inbound | None, src_rank: int) -> None:
        """An authentic DATA message of a transfer that ended here: its source rank is told the outcome (a
        transfer that ended DONE cannot take more data: UNKNOWN), if the reservation named its address."""
        ctx = self.ctx
        if inbound is not None:
            status, senders = STATUS_FOR[inbound.state], inbound.senders
        elif (tombstone := ctx.tombstones.get(key)) is not None:
            status, senders = tombstone.status, tombstone.senders
        else:
            ctx.drops.count("unknown_transfer", f"DATA from rank {src_rank} for key {key:#x}, forgotten")
            return
        ctx.drops.count("late", f"DATA from rank {src_rank} for a transfer that ended {status.name}")
        if src_rank < len(senders):
            ctx.replies.send(senders[src_rank], key, Kind.ACK, status if status is not Status.OK else Status.UNKNOWN)
