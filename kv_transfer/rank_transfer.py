"""One transfer as one rank's agent tracks it: an Inbound (receiving into reserved blocks) or an Outbound
(sending from a KV store), the Tombstone it leaves once forgotten, and the mapping between transfer states and
the status codes on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.kv_transfer.descriptor import TransferDescriptor, TransferState
from tandem.kv_transfer.plan import Message
from tandem.kv_transfer.staging import Slot
from tandem.kv_transfer.wire import DataHeader, Status

# A peer's status code -> the state it puts this side in; this side's ended state -> the code it reports.
STATE_FOR = {Status.ABORTED: TransferState.ABORTED, Status.EXPIRED: TransferState.EXPIRED,
             Status.UNKNOWN: TransferState.FAILED, Status.BAD_MESSAGE: TransferState.FAILED}
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
    """senders: the sending replica's agent addresses by source rank, as the reservation named them: the only
    peers this side answers (empty: nobody; the senders then learn the outcome from their leases). seen: the
    source ranks an authentic message came from. sent_by: the source ranks whose authentic ACK said they sent
    this rank everything (AgentReceiver.on_sent). max_message: the most bytes (header included) a DATA message
    of this reservation may have."""

    block_ids: tuple[int, ...] = ()
    senders: tuple[str, ...] = ()
    max_message: int = 0
    expected: int | None = None  # DATA messages this rank receives, learnt from the first header
    arrived: set[int] = field(default_factory=set)
    seen: set[int] = field(default_factory=set)
    sent_by: dict[int, float] = field(default_factory=dict)  # source rank -> when it said it sent everything

    def problem_with(self, header: DataHeader, index: int, layers: range, kv_heads: range,
                     bytes_per_block_layer_head: int) -> tuple[Status, str] | None:
        """(status, reason) for an authentic DATA header (its payload_bytes arrived) that does not fit this
        reservation and the receiving rank's layers and KV heads, else None."""
        expected = len(header.layers) * len(header.kv_heads) * len(header.blocks) * bytes_per_block_layer_head
        reason = None
        if header.index != index:
            reason = f"header index {header.index} under tag index {index}"
        elif not (header.layers and header.kv_heads and header.blocks):
            reason = f"message {index} names an empty slice"
        elif header.payload_bytes != expected:
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


@dataclass(frozen=True)
class Tombstone:
    """What an agent remembers of a transfer it forgot, for tombstone_s: its outcome, and (receiving side) whom
    to tell it and how long its messages may be, to answer late messages."""

    status: Status
    ended_at: float  # the agent's clock
    senders: tuple[str, ...] = ()
    max_message: int = 0


@dataclass
class Outbound(RankTransfer):
    descriptor: TransferDescriptor | None = None
    seq_id: str | None = None
    messages: tuple[Message, ...] = ()
    counts: dict[int, int] = field(default_factory=dict)  # destination rank -> its messages from every source
    sent: set[int] = field(default_factory=set)
    source_blocks: tuple[int, ...] = ()  # the blocks sent from, once sending started
    pending: list[tuple[object, Slot | None, str]] = field(default_factory=list)  # (handle, slot or None, peer)
    acked: set[int] = field(default_factory=set)
    held: dict[int, list[Slot]] = field(default_factory=dict)  # destination rank -> slots it reads by reference
    waited_in_vain: bool = False  # a wait for a shared staging slot timed out (it does not wait again)
    store_readers: set[int] = field(default_factory=set)  # destination ranks sent refs into the KV store
    answered: set[int] = field(default_factory=set)  # destination ranks that sent an ACK (of any status)
    announced: bool = False  # every message went out and the destination ranks were told so
