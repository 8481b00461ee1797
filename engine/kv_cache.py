"""Paged KV storage: one allocation holding every layer's K and V blocks.

Policy (which block belongs to whom) lives in the block pool; this file only owns the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a paged KV store. Sizes in elements; block_size in tokens."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


class PagedKVCache:
    """data[layer, 0 | 1, block, kv_head, slot, dim]: K at 0, V at 1; head-major inside a block (see
    attention/torch_ref.py). One tensor, so it registers once for transfer."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu",
                 host_memory: Callable[[int], tuple[np.ndarray, object]] | None = None):
        """The store starts zeroed. Attention reads slots no token has written yet (the tail of a sequence's
        last block, padding) and masks them with zero weights, and 0 * NaN is NaN: left-over heap memory can
        hold NaN. On the CPU the zeros come from calloc, so the pages stay untouched until first written.
        host_memory(nbytes) -> (zeroed uint8 bytes, their owner): where a CPU store lives instead (shared memory
        a KV transfer agent lets same-host peers read, kv_transfer/shm.py); the owner is kept as memory_owner."""
        self.spec = spec
        self.memory_owner = None
        shape = (spec.num_layers, 2, spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        if torch.device(device).type == "cpu":
            nbytes = spec.bytes_per_block * spec.num_blocks
            if host_memory is None:
                raw = np.zeros(nbytes, dtype=np.uint8)
            else:
                raw, self.memory_owner = host_memory(nbytes)
            self.data = torch.from_numpy(raw[:nbytes]).view(spec.dtype).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=spec.dtype, device=device)

    def layer(self, index: int) -> torch.Tensor:
        """One layer's cache, a view [2, num_blocks, num_kv_heads, block_size, head_dim]: K at 0, V at 1."""
        return self.data[index]

    def copy_blocks(self, pairs) -> None:
        """Copies every layer's K and V of block src into block dst, for each (src, dst) pair, in one op."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]


def store_memory_of(kv_agent: object, device: torch.device | str) -> Callable[[int], tuple[np.ndarray, object]] | None:
    """Where a KV transfer agent factory wants a rank's CPU KV store (PagedKVCache's host_memory): what its
    store_memory(device) returns, if it has that method (kv_transfer/agent_factory.py); else None."""
    offer = getattr(kv_agent, "store_memory", None)
    return offer(torch.device(device)) if offer is not None else None
