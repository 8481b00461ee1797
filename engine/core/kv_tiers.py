"""KV tiers below the device pool: which evicted prefix blocks are kept in host memory and on local disk, and the
copies that move them. Policy only, plain Python: the bytes move on every rank (engine/kv/tier_store.py), as the
ordered copies this class writes into each step's SchedulerOutput.tier_ops say.

A block's life across the tiers:
  1. A cached block whose last owner lets go is parked in the device pool (engine/kv/block_pool.py). At the next
     step it is copied to a host slot (save), unless the host tier has its hash already: a block leaves the device
     already copied, so evicting it later costs nothing, and the copy runs beside the step that follows.
  2. The host tier is LRU in its byte budget: the block a save displaces spills to the disk tier (or is dropped
     without one); the disk tier is LRU too, and the file it displaces is deleted.
  3. A waiting request whose prefix goes on past the device's cached blocks, on the host or the disk tier, gets
     device blocks for that run and waits (WAITING_FOR_TIER) while they are copied up (disk -> host -> device);
     the step after, it is scheduled with them computed. The batch does not wait for it.
  4. A disk read or write that fails (missing, truncated or corrupt file, full disk, I/O error) is reported by the
     ranks: the block leaves the tier index, the reason is counted, and the loading request's run stops before it
     (the rest is recomputed). Nothing read from disk is used unchecked (engine/kv/disk_blocks.py).
Copies are ordered: a save reading a device block that this same step hands to a sequence the model writes must
run before the model (TierOps.sync), every other copy runs on a copy thread while the model computes; all are done
when the step ends, so no copy is in flight between steps (a reservation, an abort or a transfer never races one).
Block hashes carry the tenant's salt (engine/kv/prefix_cache.py), so the tiers are tenant-scoped as the pool is.
Every block that enters or leaves a tier is published as a KV event naming the tier (engine/kv/kv_events.py), so
the router's prefix index knows where each replica holds a prefix; hit_costs() says what a hit on each tier costs
against recomputing the block, from the copies' measured times and the replica's prefill speed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

from tandem.engine.kv.kv_events import DISK, HOST, BlockRemoved, BlockStored, KVEventSink, discard_events
from tandem.engine.kv.tier_index import TierIndex
from tandem.engine.scheduler_output import (DropBlock, FetchBlock, LoadBlocks, SaveBlocks, SpillBlock, TierOp,
                                            TierOps, TierReport)

@dataclass(frozen=True)
class TierStats:
    """Blocks each tier holds and can hold, prefix blocks found there, copies made and failures by reason."""

    host_blocks: int
    host_capacity: int
    disk_blocks: int
    disk_capacity: int
    host_hits: int  # prefix blocks a request got from the host tier
    disk_hits: int  # ... from the disk tier (read, checked, copied up)
    saved: int  # device -> host copies
    spilled: int  # host -> disk copies
    dropped: int  # blocks that left the last tier
    failures: dict[str, int]  # reason -> count (disk reads and writes that failed: recomputed)
    block_bytes: int = 0  # one block's bytes (every rank's share)
    loaded_blocks: int = 0  # host -> device copies timed, and the seconds they took
    load_s: float = 0.0
    read_blocks: int = 0  # disk -> host reads timed, and the seconds they took
    read_s: float = 0.0


@dataclass(frozen=True)
class TierHitCosts:
    """What bringing one prefix block up to the device from each tier costs, as a fraction of recomputing it:
    0 is as cheap as a device hit, 1 as dear as recomputing (more: dearer). measured: False while a tier has not
    been read from or the replica has not prefilled yet (then the priors below stand in for what is missing)."""

    host: float
    disk: float
    measured: bool = False


# Before anything is measured: a host copy moves a block at memory bandwidth, far faster than computing it; a disk
# read is slower but usually still beats recomputing a long prefix (LMCache and SGLang HiCache report both).
PRIOR_HIT_COSTS = TierHitCosts(host=0.1, disk=0.5)


def hit_costs(stats: TierStats, prefill_tokens_per_s: float | None, block_size: int) -> TierHitCosts:
    """Each tier's hit cost from the copies' measured seconds per block against the seconds the replica takes to
    prefill block_size tokens (prefill_tokens_per_s: its measured prefill speed; None: not measured yet). A disk
    hit is a read and then a host copy."""
    if not prefill_tokens_per_s:
        return PRIOR_HIT_COSTS
    recompute_s = block_size / prefill_tokens_per_s
    host_s = stats.load_s / stats.loaded_blocks if stats.loaded_blocks else None
    host = host_s / recompute_s if host_s is not None else PRIOR_HIT_COSTS.host
    if stats.read_blocks:
        disk = (stats.read_s / stats.read_blocks + (host_s or 0.0)) / recompute_s
    else:
        disk = max(PRIOR_HIT_COSTS.disk, host)
    return TierHitCosts(host, disk, host_s is not None and bool(stats.read_blocks or stats.disk_capacity == 0))


class KVTiers:
    """The host tier (host_slots blocks) and the optional disk tier (disk_slots blocks) of one replica."""

    def __init__(self, host_slots: int, disk_slots: int = 0, sink: KVEventSink = discard_events, *,
                 block_bytes: int = 0):
        """sink: receives a BlockStored / BlockRemoved naming the tier for every block entering or leaving one.
        block_bytes: one block's bytes over every rank (for stats)."""
        self.block_bytes = block_bytes
        self.host = TierIndex(HOST, host_slots, 1)
        self.disk = TierIndex(DISK, disk_slots, 1) if disk_slots else None
        self._sink = sink
        self._ops: list[TierOp] = []
        self._save_blocks: list[int] = []  # the save being gathered (one op for the step's saves, where order allows)
        self._save_slots: list[int] = []
        self._saved_at: dict[int, int | None] = {}  # device block saved this step -> its op's index (None: gathering)
        self._sync = 0
        self._counts: Counter[str] = Counter()
        self._copy_s: Counter[str] = Counter()  # tier -> seconds its timed copies up took
        self._copied: Counter[str] = Counter()  # tier -> blocks those copies moved
        self.failures: Counter[str] = Counter()

    # -- down: device -> host -> disk ----------------------------------------------------------------------

    def save(self, blocks: Iterable[tuple[int, int]]) -> None:
        """Copies parked device blocks, given as (block hash, block id), to the host tier (those it lacks)."""
        for block_hash, block in blocks:
            if self.host.lookup(block_hash) is not None:
                continue
            admission = self.host.admit(block_hash)
            if admission is None:
                continue
            for victim, slot in admission.evicted:
                self._leave_host(victim, slot)
            self.host.ready(block_hash)  # readable: any copy out of the slot is ordered after this one
            self._stored(HOST, block_hash)
            self._save_blocks.append(block)
            self._save_slots.append(admission.slot)
            self._saved_at[block] = None
            self._counts["saved"] += 1

    def _leave_host(self, block_hash: int, slot: int) -> None:
        """A host block displaced from `slot`: to the disk tier, or gone."""
        self._sink(BlockRemoved((block_hash,), HOST))
        if self.disk is None:
            self._counts["dropped"] += 1
            return
        if self.disk.lookup(block_hash) is not None:
            return  # the disk has it already
        admission = self.disk.admit(block_hash)
        if admission is None:
            self._counts["dropped"] += 1
            return
        for victim, _ in admission.evicted:
            self._emit(DropBlock(victim))
            self._sink(BlockRemoved((victim,), DISK))
            self._counts["dropped"] += 1
        if slot in self._save_slots:  # the slot was filled this step: that copy first, then this one reads it
            self._flush()
        self._emit(SpillBlock(slot, block_hash))
        self.disk.ready(block_hash)
        self._stored(DISK, block_hash)
        self._counts["spilled"] += 1

    def reused(self, blocks: Iterable[int]) -> None:
        """Device blocks evicted from the pool this step (the model or a copy may write them): a save of any of
        them made this step must run before the step writes."""
        for block in blocks:
            if block not in self._saved_at:
                continue
            if self._saved_at[block] is None:
                self._flush()
            self._sync = max(self._sync, self._saved_at[block] + 1)

    # -- up: disk -> host -> device ------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, the host or disk tier holds."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.host and (self.disk is None or block_hash not in self.disk):
                break
            count += 1
        return count

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        """Copies a run of prefix blocks (hashes[i] into device block blocks[i]; match() said they are here) up to
        the device: from host slots, disk blocks through a host slot first; a run longer than the host tier in
        pieces of its size (each piece's slots are reused by the next, after its copy). Counts the hits."""
        self._flush()  # a slot saved this step is read only after it was written
        for start in range(0, len(hashes), self.host.num_slots):
            self._load_piece(hashes[start:start + self.host.num_slots], blocks[start:start + self.host.num_slots])

    def _load_piece(self, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        on_host = {h: self.host.pin(h) for h in hashes if h in self.host}  # not displaced by the rest of the run
        # ... nor a disk block by what staging the others spills: its file is read after those spills
        on_disk = [h for h in hashes if h not in on_host and self.disk.pin(h) is not None]
        for block_hash in on_host:
            self.host.lookup(block_hash)  # most recently used
        slots = []
        for block_hash in hashes:
            slot = on_host.get(block_hash)
            if slot is None:
                admission = self.host.admit(block_hash)
                if admission is None:
                    raise ValueError(f"the host tier cannot stage block {block_hash:#x}: every slot is pinned")
                for victim, victim_slot in admission.evicted:
                    self._leave_host(victim, victim_slot)
                self.disk.lookup(block_hash)
                self._emit(FetchBlock(block_hash, admission.slot))
                self.host.ready(block_hash)
                self._stored(HOST, block_hash)
                on_host[block_hash] = slot = self.host.pin(block_hash)
                self._counts["disk_hits"] += 1
            else:
                self._counts["host_hits"] += 1
            slots.append(slot)
        self._emit(LoadBlocks(tuple(slots), tuple(blocks), tuple(hashes)))
        for block_hash in on_host:
            self.host.unpin(block_hash)
        for block_hash in on_disk:
            self.disk.unpin(block_hash)

    # -- the step's copies and their outcome ---------------------------------------------------------------

    def _flush(self) -> None:
        if self._save_blocks:
            index = len(self._ops)
            self._ops.append(SaveBlocks(tuple(self._save_blocks), tuple(self._save_slots)))
            for block in self._save_blocks:
                self._saved_at[block] = index
            self._save_blocks, self._save_slots = [], []

    def _emit(self, op: TierOp) -> None:
        self._ops.append(op)

    def _stored(self, tier: str, block_hash: int) -> None:
        self._sink(BlockStored(block_hash, None, (), None, tier))

    def take_ops(self) -> TierOps:
        """This step's copies, in order (and forgets them)."""
        self._flush()
        ops = TierOps(tuple(self._ops), self._sync)
        self._ops, self._saved_at, self._sync = [], {}, 0
        return ops

    def done(self, report: TierReport) -> set[int]:
        """Applies the ranks' report of a step's copies: their times, and its failed disk reads and writes (see
        failed()). Returns the failed hashes."""
        for tier, blocks, seconds in report.times:
            self._copied[tier] += blocks
            self._copy_s[tier] += seconds
        return self.failed(report.failed)

    def failed(self, failures: Iterable[tuple[int, str]]) -> set[int]:
        """Applies the ranks' report of failed disk reads and writes, (block hash, reason) each: those blocks
        leave both tiers (a failed read's host slot holds nothing valid). Returns the failed hashes."""
        hashes = set()
        for block_hash, reason in failures:
            if block_hash in hashes:
                continue
            hashes.add(block_hash)
            self.failures[reason.split(":")[0]] += 1
            for tier in (self.host, self.disk):
                if tier is not None and tier.remove(block_hash) is not None:
                    self._sink(BlockRemoved((block_hash,), tier.name))
        return hashes

    def stats(self) -> TierStats:
        c = self._counts
        disk = self.disk
        return TierStats(len(self.host), self.host.num_slots, len(disk) if disk is not None else 0,
                         disk.num_slots if disk is not None else 0, c["host_hits"], c["disk_hits"], c["saved"],
                         c["spilled"], c["dropped"], dict(self.failures), self.block_bytes, self._copied[HOST],
                         self._copy_s[HOST], self._copied[DISK], self._copy_s[DISK])

    def hashes(self, tier: str) -> tuple[int, ...]:
        """Every readable block hash on `tier` ("host" or "disk"), for a KV snapshot."""
        index = self.host if tier == HOST else self.disk
        return index.hashes() if index is not None else ()

    def check_integrity(self) -> None:
        """Raises ValueError if a tier's index is inconsistent or copies were left ungathered."""
        self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        if self._ops or self._save_blocks:
            raise ValueError("KV tier copies were written but never handed to the runner")
