"""Block tables of the running sequences over one block pool and its prefix cache.

It answers the scheduler's two questions, "which blocks of this prompt are cached already?" (match_prefix)
and "give this sequence room for N more tokens" (allocate), and keeps three promises:
  - a block whose KV will be written is owned by the writer alone: a block shared after a fork is copied
    first (copy-on-write) and the copy is reported for the model runner to perform before the step;
  - a full block whose KV has been computed is registered in the prefix cache (cache_full_blocks), and
    stays reusable after its owners finish until it is evicted, least recently released first;
  - free() returns every block at once; no other path changes ownership.
With KV tiers (engine/core/kv_tiers.py) a parked block is also copied below the pool at the next step
(save_parked), and a prefix can go on past the pool's blocks on a tier (match_tiers, load_from_tiers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.core.kv_tiers import KVTiers
from tandem.engine.kv.block_pool import BlockPool
from tandem.engine.kv.kv_events import KVEventSink, discard_events
from tandem.engine.kv.prefix_cache import MatchResult, PrefixCache
from tandem.engine.request import Sequence
from tandem.engine.scheduler_output import TierOps


@dataclass(frozen=True)
class Allocation:
    """new_blocks: block ids appended to the sequence's table. copies: (source, destination) block pairs the
    runner must copy before this step (copy-on-write); replaced: the table changed in place (not just grew)."""

    new_blocks: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()
    replaced: bool = False


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache (or found there)


NO_MATCH = MatchResult((), 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 event_sink: KVEventSink = discard_events, tiers: KVTiers | None = None):
        self.block_size = block_size
        self.tiers = tiers
        self._parked_since: list[int] = []  # blocks parked since the last save_parked (tiers only)
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache(block_size, event_sink)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, _Table] = {}
        self._held: dict[str, list[str]] = {}  # hold key -> the names of its tables in _tables

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's blocks in token order (empty when it holds none). Callers must not mutate it."""
        table = self._tables.get(seq_id)
        return table.blocks if table else []

    def usage(self) -> float:
        """Fraction of blocks owned by sequences (parked cached blocks count as free)."""
        return self.pool.num_in_use / self.pool.num_blocks

    def match_prefix(self, seq: Sequence) -> MatchResult:
        """Cached blocks of seq's prefix. At least one token is always left to compute, because the step that
        computes the last token is the one that yields the next token's logits."""
        if not self.enable_prefix_caching:
            return NO_MATCH
        return self.cache.match(seq.block_hashes, max_blocks=(seq.num_tokens - 1) // self.block_size)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: MatchResult = NO_MATCH) -> Allocation | None:
        """Makes room for seq's KV up to seq.num_computed_tokens + cached tokens + num_new_tokens.

        `cached` (only on a sequence's first allocation) is taken over as the head of its table. Returns None,
        changing nothing, when there are not enough blocks; the scheduler then preempts someone or waits.
        """
        table = self._tables.get(seq.seq_id)
        if table is None:
            if seq.num_computed_tokens:
                raise ValueError(f"sequence {seq.seq_id} has computed tokens but no blocks")
            table = _Table()
        elif cached.blocks:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks; a prefix match applies only to a new one")
        start = seq.num_computed_tokens + cached.num_cached_tokens
        end = start + num_new_tokens
        num_existing = len(table.blocks) + len(cached.blocks)
        num_new = max(0, self.blocks_for(end) - num_existing)
        # Blocks this step writes into that someone else also owns must be copied first.
        shared = [i for i in range(start // self.block_size, min(self.blocks_for(end), len(table.blocks)))
                  if self.pool.ref_count(table.blocks[i]) > 1]
        revived = sum(1 for b in cached.blocks if self.pool.is_parked(b))
        if num_new + len(shared) > self.pool.num_available - revived:
            return None
        for block in cached.blocks:
            self.pool.incref(block)
        if cached.blocks:
            table.blocks.extend(cached.blocks)
            table.num_cached_blocks = len(cached.blocks)
        fresh = self._take(num_new + len(shared))
        copies = []
        for i, block in zip(shared, fresh[num_new:]):
            copies.append((table.blocks[i], block))
            self._release(table.blocks[i])
            table.blocks[i] = block
        table.blocks.extend(fresh[:num_new])
        self._tables[seq.seq_id] = table
        return Allocation(tuple(fresh[:num_new]), tuple(copies), replaced=bool(copies))

    def _take(self, count: int) -> list[int]:
        shortfall = count - self.pool.num_free
        if shortfall > 0:
            victims = self.pool.evict(shortfall)
            if self.tiers is not None:
                self.tiers.reused(victims)
            self.cache.forget(victims)
        return self.pool.allocate(count)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers seq's full blocks whose KV is computed (after a step). A hash another block holds already
        leaves this block private; the hash chain goes on regardless."""
        table = self._tables.get(seq.seq_id)
        if table is None or not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(table.num_cached_blocks, num_full):
            parent = seq.block_hashes[i - 1] if i else None
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            self.cache.insert(table.blocks[i], seq.block_hashes[i], parent, tokens, seq.hash_salt)
        table.num_cached_blocks = max(table.num_cached_blocks, num_full)

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Gives back seq's blocks past those that hold its first num_tokens tokens (blocks a step took for
        speculated tokens that were rejected). Returns how many."""
        table = self._tables.get(seq.seq_id)
        keep = self.blocks_for(num_tokens)
        if table is None or len(table.blocks) <= keep:
            return 0
        extra = table.blocks[keep:]
        del table.blocks[keep:]
        for block in reversed(extra):
            self._release(block)
        return len(extra)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (one more owner each)."""
        source = self._tables[parent.seq_id]
        for block in source.blocks:
            self.pool.incref(block)
        self._tables[child.seq_id] = _Table(list(source.blocks), source.num_cached_blocks)

    def hold(self, seq: Sequence, key: str) -> None:
        """One more owner of each of seq's blocks, under key (several holds may share a key), until
        release(key): the blocks outlive seq's free() (a peer may still read them)."""
        table = self._tables.get(seq.seq_id)
        if table is not None:
            self._hold(key, table.blocks)

    def hold_cached(self, key: str, hashes: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        """One more owner, under key until release(key), of each block of the prefix cache's longest run of
        `hashes` (parked ones come back into use). Returns those blocks in order (empty: nothing held)."""
        blocks = self.cache.match(list(hashes)).blocks
        if blocks:
            self._hold(key, blocks)
        return blocks

    def _hold(self, key: str, blocks: list[int] | tuple[int, ...]) -> None:
        for block in blocks:
            self.pool.incref(block)
        names = self._held.setdefault(key, [])
        names.append(f"{key}#hold{len(names)}")  # never a sequence id: those end in #<sample index>
        self._tables[names[-1]] = _Table(list(blocks))

    def release(self, key: str) -> int:
        """Ends every hold under key (their blocks are freed or parked as free() would). Returns how many."""
        names = self._held.pop(key, [])
        for name in names:
            table = self._tables.pop(name)
            for block in reversed(table.blocks):
                self._release(block)
        return len(names)

    @property
    def num_holds(self) -> int:
        return sum(len(names) for names in self._held.values())

    def free(self, seq: Sequence) -> None:
        """Releases all of seq's blocks. Cached ones are parked for reuse, the last block released first so that
        eviction takes a prefix's tail before its head."""
        table = self._tables.pop(seq.seq_id, None)
        if table is None:
            return
        for block in reversed(table.blocks):
            self._release(block)

    def _release(self, block: int) -> None:
        """Drops one owner; a cached block left with none is parked (and, with tiers, saved at the next step)."""
        cached = self.cache.is_cached(block)
        if self.pool.decref(block, park=cached) == 0 and cached and self.tiers is not None:
            self._parked_since.append(block)

    # -- KV tiers ----------------------------------------------------------------------------------------

    def save_parked(self) -> None:
        """Copies the blocks parked since the last call, those still parked, to the tiers (at a step's start)."""
        if self.tiers is None:
            return
        parked, self._parked_since = self._parked_since, []
        self.tiers.save((self.cache.hash_of(b), b) for b in dict.fromkeys(parked) if self.pool.is_parked(b))

    def match_tiers(self, seq: Sequence, cached: MatchResult) -> int:
        """How many blocks of seq's prefix, after the pool's `cached` ones, the tiers hold (0 without tiers).
        At least one token is left to compute, as for match_prefix."""
        if self.tiers is None or not self.enable_prefix_caching:
            return 0
        first = len(cached.blocks)
        return self.tiers.match(seq.block_hashes[first:(seq.num_tokens - 1) // self.block_size])

    def load_from_tiers(self, seq: Sequence, first: int, count: int) -> None:
        """Copies tier blocks first..first + count - 1 of seq's prefix into the blocks its table holds there
        (allocated for them). They count as computed once the step's copies succeeded (the scheduler's call)."""
        blocks = self._tables[seq.seq_id].blocks[first:first + count]
        self.tiers.load(seq.block_hashes[first:first + count], blocks)

    def take_tier_ops(self) -> TierOps:
        return self.tiers.take_ops() if self.tiers is not None else TierOps()

    def reset_prefix_cache(self) -> int:
        """Evicts every parked block. Returns how many were dropped."""
        victims = self.pool.evict_all()
        self.cache.forget(victims)
        return len(victims)

    def check_integrity(self) -> None:
        """Raises ValueError unless the pool is consistent, every owner count equals the number of tables
        holding the block, and every cached block is in use or parked."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        owners: dict[int, int] = {}
        for table in self._tables.values():
            for block in table.blocks:
                owners[block] = owners.get(block, 0) + 1
        for block, count in owners.items():
            if self.pool.ref_count(block) != count:
                raise ValueError(f"block {block} has {self.pool.ref_count(block)} owners counted, {count} tables")
        if len(owners) != self.pool.num_in_use:
            raise ValueError(f"{self.pool.num_in_use} blocks in use but {len(owners)} held by tables")
        for block in range(self.pool.num_blocks):
            if self.cache.is_cached(block) and not (self.pool.ref_count(block) or self.pool.is_parked(block)):
                raise ValueError(f"block {block} is cached but free")
            if self.pool.is_parked(block) and not self.cache.is_cached(block):
                raise ValueError(f"block {block} is parked without a cached hash")
        if self.tiers is not None:
            self.tiers.check_integrity()
