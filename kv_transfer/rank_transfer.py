"""One transfer as one rank's agent tracks it: an Inbound (receiving into reserved blocks) or an Outbound
(sending from a KV store), and the mapping between transfer states and the status codes on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.kv_transfer.descriptor import TransferDescriptor, TransferState
from tandem.kv_transfer.plan import Message
from tandem.kv_transfer.staging import Slot
from tandem.kv_transfer.wire import DataHeader, Status

# A peer's status code -> the state it puts this side in; this side's ended state -> the code it reports.
STATE_FOR = {Status.CHECKSUM: TransferState.FAILED, Status.ABORTED: TransferState.ABORTED,
             Status.EXPIRED: TransferState.EXPIRED, Status.UNKNOWN: TransferState.FAILED,
             Status.BAD_MESSAGE: TransferState.FAILED}
STATUS_FOR = {TransferState.FAILED: Status.BAD_MESSAGE, TransferState.ABORTED: Status.ABORTED,
              TransferState.EXPIRED: Status.EXPIRED, TransferState.DONE: Status.OK}


@dataclass
class RankTransfer:
    transfer_id: str
    deadline: float
    state: TransferState = TransferState.RESERVED
    nbytes: int = 0
    error: str | None = None

    def end(self, state: TransferState, error: str | None) -> bool:
        """Moves to a terminal state; False (and no change) if already there."""
        if self.state.terminal:
            return False
        self.state, self.error = state, error
        return True


@dataclass
class Inbound(RankTransfer):
    block_ids: tuple[int, ...] = ()
    expected: int | None = None  # DATA messages this rank receives, learnt from the first header
    arrived: set[int] = field(default_factory=set)
    senders: set[str] = field(default_factory=set)

    def problem_with(self, header: DataHeader, index: int, room: int, layers: range, kv_heads: range,
                     bytes_per_block_layer_head: int) -> tuple[Status, str] | None:
        """(status, reason) for a DATA header that does not fit this reservation and the receiving rank's
        layers and KV heads (room: payload bytes that arrived), else None."""
        expected = len(header.layers) * len(header.kv_heads) * len(header.blocks) * bytes_per_block_layer_head
        reason = None
        if header.index != index:
            reason = f"header index {header.index} under tag index {index}"
        elif header.payload_bytes != expected or header.payload_bytes > room:
            reason = f"message {index} carries {header.payload_bytes} bytes for a slice of {expected}"
        elif not (header.layers.start in layers and header.layers.stop - 1 in layers and
                  header.kv_heads.start in kv_heads and header.kv_heads.stop - 1 in kv_heads):
            reason = (f"message {index} is for layers {header.layers.start}-{header.layers.stop - 1}, KV heads "
                      f"{header.kv_heads.start}-{header.kv_heads.stop - 1}; this rank holds layers "
                      f"{layers.start}-{layers.stop - 1}, KV heads {kv_heads.start}-{kv_heads.stop - 1}")
        elif header.blocks.stop > len(self.block_ids):
            reason = f"message {index} names blocks up to {header.blocks.stop}, {len(self.block_ids)} reserved"
        elif index in self.arrived or self.expected not in (None, header.msgs_for_dst):
            reason = f"message {index} arrived twice or disagrees on the message count"
        return None if reason is None else (Status.BAD_MESSAGE, reason)


@dataclass
class Outbound(RankTransfer):
    descriptor: TransferDescriptor | None = None
    seq_id: str | None = None
    messages: tuple[Message, ...] = ()
    counts: dict[int, int] = field(default_factory=dict)  # destination rank -> its messages from every source
    sent: set[int] = field(default_factory=set)
    source_blocks: tuple[int, ...] = ()  # the blocks sent from, once sending started
    pending: list[tuple[object, Slot, str]] = field(default_factory=list)  # (handle, slot, peer)
    acked: set[int] = field(default_factory=set)
