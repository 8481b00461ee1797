"""What both sides of one rank's transfer agent share (kv_transfer/agent.py composes them): the rank's share of
the KV store and its format, the copier, the staging pool, the transport with its MAC key and replies, the drop
counter, the tombstones of forgotten transfers, and the one lock that guards every side's bookkeeping."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat
from tandem.kv_transfer.device_copy import KVCopier
from tandem.kv_transfer.drops import DropCounter
from tandem.kv_transfer.rank_transfer import Tombstone
from tandem.kv_transfer.replies import Replies
from tandem.kv_transfer.shm import SharedSegment
from tandem.kv_transfer.staging import StagingPool
from tandem.kv_transfer.transport import Transport
from tandem.kv_transfer.wire import MessageKey


@dataclass
class AgentContext:
    """shm: the shared staging buffer (None: same-host messages by reference are off); shm_domain: its domain
    ("" when off). lock: held for bookkeeping only, never while waiting on the network; slot_freed is notified
    whenever a staging slot comes back. tombstones: key -> the outcome of a forgotten transfer, for late
    messages (both sides leave them)."""

    rank: int
    config: TransferConfig
    clock: Callable[[], float]
    transport: Transport
    key: MessageKey
    format: KVFormat
    layers: range
    kv_heads: range
    copier: KVCopier
    staging: StagingPool
    shm: SharedSegment | None
    shm_domain: str
    replies: Replies
    drops: DropCounter
    lock: threading.RLock = field(default_factory=threading.RLock)
    tombstones: dict[int, Tombstone] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.slot_freed = threading.Condition(self.lock)
