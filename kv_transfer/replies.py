"""The status messages a transfer agent sends (ACK: receiver -> sender, ABORT: sender -> receiver): sealed with
the cluster's MAC (kv_transfer/wire.py), and only ever to an address the agent was given when the transfer was
set up (the reservation's senders, the descriptor's addresses), never to one a message names. Sends never
block; one that cannot start is given up (the peer learns the outcome from its own lease instead).

Called under the agent's lock (kv_transfer/agent.py); holds nothing of the agent's.
"""

from __future__ import annotations

import numpy as np

from tandem.kv_transfer.rank_transfer import STATUS_FOR, Inbound, Outbound
from tandem.kv_transfer.transport import Handle, Transport
from tandem.kv_transfer.wire import Kind, MessageKey, Status, StatusMessage, make_tag


class Replies:
    def __init__(self, transport: Transport, key: MessageKey, rank: int):
        """rank: this agent's rank, which every status message names (and its tag's index carries)."""
        self.transport, self.key, self.rank = transport, key, rank
        self._sending: list[tuple[Handle, np.ndarray]] = []  # buffers kept alive until their sends are done

    def send(self, peer: str, key: int, kind: Kind, status: Status) -> None:
        """Sends one ACK or ABORT for the transfer under key to peer."""
        tag = make_tag(key, kind, self.rank)
        buffer = np.frombuffer(StatusMessage(status, self.rank).seal(self.key, tag), dtype=np.uint8).copy()
        try:
            self._sending.append((self.transport.send(peer, tag, buffer), buffer))
        except Exception:
            pass  # a closed transport: the peer learns the outcome from its own lease

    def tell_senders(self, key: int, inbound: Inbound, status: Status | None = None, *,
                     every_named: bool = False) -> None:
        """ACKs status (default: the one inbound's state stands for) to every source rank an authentic message
        came from (every_named: every rank the reservation named, heard from or not), at the address the
        reservation named for it (none named: nobody is told)."""
        status = STATUS_FOR[inbound.state] if status is None else status
        for rank in range(len(inbound.senders)) if every_named else sorted(inbound.seen):
            if rank < len(inbound.senders):
                self.send(inbound.senders[rank], key, Kind.ACK, status)

    def tell_receivers(self, key: int, out: Outbound) -> None:
        """ABORTs with out's (ended) state to every destination rank it feeds, at the descriptor's addresses."""
        for dst in sorted({m.dst_rank for m in out.messages}):
            self.send(out.descriptor.addresses[dst], key, Kind.ABORT, STATUS_FOR[out.state])

    def prune(self) -> None:
        """Forgets the sends that are done."""
        self._sending = [(h, b) for h, b in self._sending if not h.done()]

    @property
    def busy(self) -> bool:
        return bool(self._sending)
