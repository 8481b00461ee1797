"""Messages a transfer agent took off the wire and dropped without acting on them, counted by reason. An agent
trusts nothing a peer sends until its MAC is checked, and nothing a peer names (a length, a transfer) until it
fits what the agent itself set up; everything else is dropped here, never raised, and never touches a transfer
other than the one it authenticated for.

Plain Python: MessageDrops crosses to the router in ReplicaStats (replica/contract.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MessageDrops:
    """Dropped messages by reason, since the agent started (summed over ranks for a replica):

    forged: the MAC did not match (no or another cluster secret, corrupted in transit, moved to another tag).
    malformed: too short, the wrong length for its kind, a kind or status code we do not know, fields that do
        not parse, or a receive the transport cut off.
    oversized: longer than any message of the reservation it names may be (drained without room for it).
    unknown_transfer: for a transfer this agent neither holds nor remembers.
    late: authentic, for a transfer that already ended here (answered with its outcome where the sender is
        known)."""

    forged: int = 0
    malformed: int = 0
    oversized: int = 0
    unknown_transfer: int = 0
    late: int = 0

    def __add__(self, other: MessageDrops) -> MessageDrops:
        return MessageDrops(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def by_reason(self) -> tuple[tuple[str, int], ...]:
        """(reason, count) for every reason, in field order."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


REASONS = tuple(f.name for f in dataclasses.fields(MessageDrops))
_EXPECTED = ("late",)  # what honest peers cause too (outcomes that cross): logged at debug level only


class DropCounter:
    """One agent's counts. count() is called from the agent's pump thread only; snapshot() from any thread (a
    snapshot may miss a count made at that moment). The first drop of each reason but "late" is logged as a
    warning, the rest at debug level, so a flood of bad messages cannot flood the log."""

    def __init__(self, rank: int):
        self.rank = rank
        self._counts = dict.fromkeys(REASONS, 0)

    def count(self, reason: str, detail: str) -> None:
        """Counts one dropped message. Raises KeyError for a reason MessageDrops does not name."""
        self._counts[reason] += 1
        level = logging.WARNING if self._counts[reason] == 1 and reason not in _EXPECTED else logging.DEBUG
        _log.log(level, "rank %d: dropped a %s message (%s)%s", self.rank, reason.replace("_", " "), detail,
                 "; further drops of this kind are logged at debug level" if level == logging.WARNING else "")

    def snapshot(self) -> MessageDrops:
        return MessageDrops(**self._counts)
