"""Automatic prefix caching: which KV block holds which full block of tokens, by chained content hash.

A full block's hash covers (parent block's hash, the block's token ids, the cache salt), so equal hashes mean
equal whole prefixes, not just equal blocks, and two tenants with different salts never share a block. The
hash is blake2b over a fixed byte encoding: the same in every process and across restarts, so the router can
compute it from a prompt and compare it with the hashes workers publish (engine/kv/kv_events.py).

The cache maps hashes to block ids; which blocks are free, parked or in use is the block pool's business.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from tandem.engine.kv.kv_events import BlockRemoved, BlockStored, KVEventSink, discard_events

BlockHasher = Callable[[int | None, Sequence[int], str | None], int]


def kv_salt(cache_salt: str | None, lora: str | None) -> str | None:
    """The salt a block's hash includes: the tenant's cache salt and the LoRA adapter the KV was computed under, so
    that KV of one adapter is never another's, nor the base model's (lora None: the tenant's salt alone)."""
    return cache_salt if lora is None else f"{cache_salt or ''}\x00lora:{lora}"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    """The 64-bit chained hash of one full block. parent_hash is None for a sequence's first block."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" * 8 if parent_hash is None else parent_hash.to_bytes(8, "little"))
    h.update(array("I", token_ids).tobytes())
    if cache_salt is not None:
        h.update(b"\x01salt:" + cache_salt.encode())
    return int.from_bytes(h.digest(), "little")


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                        hasher: BlockHasher = hash_block_tokens) -> None:
    """Appends to `hashes` the hash of every full block of token_ids not hashed yet (hashes holds those of the
    first len(hashes) blocks). Partial trailing blocks are not hashed."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hasher(parent, token_ids[start:start + block_size], cache_salt))


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                 hasher: BlockHasher = hash_block_tokens) -> list[int]:
    """Hashes of every full block of token_ids, in order."""
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, block_size, cache_salt, hasher)
    return hashes


@dataclass(frozen=True)
class MatchResult:
    """The cached blocks of a prefix, in order, and the tokens they hold (len(blocks) * block_size)."""

    blocks: tuple[int, ...]
    num_cached_tokens: int


class PrefixCache:
    """hash <-> block id for blocks whose full content is known. Publishes stored/removed events to `sink`."""

    def __init__(self, block_size: int, sink: KVEventSink = discard_events):
        self.block_size = block_size
        self._sink = sink
        self._block_by_hash: dict[int, int] = {}
        self._hash_by_block: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._block_by_hash)

    def match(self, hashes: Sequence[int], max_blocks: int | None = None) -> MatchResult:
        """The longest run of cached blocks from the first of `hashes`, at most max_blocks of them."""
        blocks: list[int] = []
        for h in hashes[:max_blocks]:
            block = self._block_by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return MatchResult(tuple(blocks), len(blocks) * self.block_size)

    def insert(self, block: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               cache_salt: str | None) -> bool:
        """Records that `block` holds the full block `block_hash`. Returns False (recording nothing) when
        another block already holds that hash: the caller keeps its block as a private copy. Raises
        ValueError if `block` already holds a different hash."""
        if block_hash in self._block_by_hash:
            return False
        if block in self._hash_by_block:
            raise ValueError(f"block {block} already caches hash {self._hash_by_block[block]:#x}")
        self._block_by_hash[block_hash] = block
        self._hash_by_block[block] = block_hash
        self._sink(BlockStored(block_hash, parent_hash, tuple(token_ids), cache_salt))
        return True

    def hashes(self) -> tuple[int, ...]:
        """Every block hash held now (for a KV snapshot)."""
        return tuple(self._block_by_hash)

    def hash_of(self, block: int) -> int | None:
        """The hash a block holds, or None."""
        return self._hash_by_block.get(block)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_by_block

    def forget(self, blocks: Iterable[int]) -> None:
        """Drops the hashes of evicted blocks (blocks without one are ignored) and publishes one removal."""
        removed = []
        for block in blocks:
            h = self._hash_by_block.pop(block, None)
            if h is not None:
                del self._block_by_hash[h]
                removed.append(h)
        if removed:
            self._sink(BlockRemoved(tuple(removed)))

    def check_integrity(self) -> None:
        """Raises ValueError unless the two maps are exact inverses."""
        if len(self._block_by_hash) != len(self._hash_by_block):
            raise ValueError("prefix cache maps differ in size")
        for h, block in self._block_by_hash.items():
            if self._hash_by_block.get(block) != h:
                raise ValueError(f"prefix cache maps disagree on block {block}")
