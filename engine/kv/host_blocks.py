"""The host tier's storage: KV blocks in host memory (pinned when the device store is a GPU's), one slot per block
holding all its layers together, and the copies between it, the device store and the disk tier's bytes.

Layout: data[slot, layer, K|V, kv_head, row, dim], so a block is one contiguous run of
KVCacheSpec.bytes_per_block bytes (a quantized store's scale rows inside it, as on the device). vLLM found that
offloading per-layer pieces made the copies about 10x slower than moving a block's layers together; here a copy of
n blocks is one gather on the device store ([layer, K|V, n, ...]) and one copy into the slots' runs, or back.
Which block sits in which slot is the tier index's business (engine/kv/tier_index.py).
"""

from __future__ import annotations

import torch

from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache


class HostBlockStore:
    """num_slots blocks of a store shaped like `spec` (its num_blocks is ignored) in host memory; pin: page-locked
    memory (for copies from and to a GPU that overlap compute)."""

    def __init__(self, spec: KVCacheSpec, num_slots: int, *, pin: bool = False):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.spec = spec
        shape = (num_slots, spec.num_layers, 2, spec.num_kv_heads, spec.rows_per_block, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    def _check(self, cache: PagedKVCache, blocks: list[int], slots: list[int]) -> None:
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks for {len(slots)} slots")
        theirs = cache.spec
        mine = self.spec
        if (theirs.num_layers, theirs.num_kv_heads, theirs.rows_per_block, theirs.head_dim, theirs.dtype) != (
                mine.num_layers, mine.num_kv_heads, mine.rows_per_block, mine.head_dim, mine.dtype):
            raise ValueError(f"the device store's blocks ({theirs}) are not this tier's ({mine})")

    def save(self, cache: PagedKVCache, blocks: list[int], slots: list[int], *, non_blocking: bool = False) -> None:
        """Copies device store blocks[i] (every layer) into slots[i]. non_blocking: on a GPU store with pinned
        slots, the copy is queued on the current stream (the caller synchronizes before reading the slots or
        overwriting the blocks). Raises ValueError for mismatched lists or stores."""
        self._check(cache, blocks, slots)
        if not blocks:
            return
        index = torch.tensor(blocks, dtype=torch.int64, device=cache.data.device)
        gathered = _as_bytes(cache.data).index_select(2, index).permute(2, 0, 1, 3, 4, 5)  # [n, layer, 2, ...]
        target = _as_bytes(self.data)
        if slots == list(range(slots[0], slots[0] + len(slots))):
            target[slots[0]:slots[0] + len(slots)].copy_(gathered, non_blocking=non_blocking)
        else:
            target[torch.tensor(slots, dtype=torch.int64)] = gathered.to("cpu", non_blocking=non_blocking)

    def load(self, cache: PagedKVCache, slots: list[int], blocks: list[int], *, non_blocking: bool = False) -> None:
        """Copies slots[i] into device store block blocks[i] (every layer). Raises ValueError as save does."""
        self._check(cache, blocks, slots)
        if not blocks:
            return
        source = _as_bytes(self.data)[torch.tensor(slots, dtype=torch.int64)]  # [n, layer, 2, ...]
        index = torch.tensor(blocks, dtype=torch.int64, device=cache.data.device)
        moved = source.to(cache.data.device, non_blocking=non_blocking).permute(1, 2, 0, 3, 4, 5)
        _as_bytes(cache.data).index_copy_(2, index, moved)

    def payload(self, slot: int) -> memoryview:
        """The slot's bytes (the disk tier's payload for its block), without a copy."""
        return memoryview(self.data[slot].contiguous().view(torch.uint8).numpy()).cast("B")

    def fill(self, slot: int, payload: bytes) -> None:
        """Puts a block's bytes (what payload() gave, read back from disk) into a slot. Raises ValueError for a
        payload of another size."""
        target = self.data[slot].view(torch.uint8).view(-1)
        if len(payload) != target.numel():
            raise ValueError(f"a block of this store is {target.numel()} bytes, not {len(payload)}")
        target.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def _as_bytes(data: torch.Tensor) -> torch.Tensor:
    """float8 stores as uint8 (index ops on float8 are not implemented everywhere); other dtypes as they are."""
    return data.view(torch.uint8) if data.element_size() == 1 else data
