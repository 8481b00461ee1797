"""Paged KV storage: one allocation holding every layer's K and V blocks.

Policy (which block belongs to whom) lives in the block pool; this file only owns the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu"):
        """The store starts zeroed. Attention reads slots no token has written yet (the tail of a sequence's
        last block, padding) and masks them with zero weights, and 0 * NaN is NaN: left-over heap memory can
        hold NaN. On the CPU the zeros come from calloc, so the pages stay untouched until first written."""
        self.spec = spec
        shape = (spec.num_layers, 2, spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        if torch.device(device).type == "cpu":
            nbytes = spec.bytes_per_block * spec.num_blocks
            self.data = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(spec.dtype).view(shape)
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
