"""Paged KV storage: one allocation holding every layer's K and V blocks.

Policy (which block belongs to whom) lives in the block pool; this file only owns the tensor.

A quantized store (int8 or fp8_e4m3 codes, engine/attention/kv_quant.py) keeps each block's scales inside the
block: every (layer, K/V, block, KV head) has block_size rows of head_dim codes and one more row whose first four
bytes are the float32 scale of those codes. So a block's bytes carry their own scales wherever they are copied
(prefix-cache copies, KV transfer), and the scale costs 1/block_size of the codes' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# KV cache dtype names (engine_config.KV_CACHE_DTYPES but auto) and the torch dtype each stores.
KV_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
              "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZED_KV = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # quantized storage dtypes and their largest code


def scale_rows(dtype: torch.dtype) -> int:
    """Rows a block of a store of dtype holds beside its tokens' (per layer, K/V and KV head): a quantized
    store's scale row, or none."""
    return 1 if dtype in QUANTIZED_KV else 0


def kv_storage_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """The dtype a KV cache of kv_cache_dtype `name` stores; auto: the compute dtype. Raises ValueError for an
    unknown name."""
    if name == "auto":
        return compute
    if name not in KV_STORAGE:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; known: auto, {', '.join(KV_STORAGE)}")
    return KV_STORAGE[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The kv_cache_dtype name of a storage dtype ("fp8_e4m3" for float8_e4m3fn)."""
    return next(name for name, d in KV_STORAGE.items() if d == dtype)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a paged KV store. Sizes in elements; block_size in tokens; dtype: what it stores (KV_STORAGE)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.quantized and self.head_dim * self.element_size < 4:
            raise ValueError(f"a {self.dtype} KV cache needs head_dim of at least 4 for its scale row")

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def rows_per_block(self) -> int:
        """Rows of head_dim elements per (layer, K/V, block, KV head): the tokens, and a quantized store's scale row."""
        return self.block_size + scale_rows(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.rows_per_block * self.num_kv_heads * self.head_dim * self.element_size


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
        shape = (spec.num_layers, 2, spec.num_blocks, spec.num_kv_heads, spec.rows_per_block, spec.head_dim)
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
        """One layer's cache, a view [2, num_blocks, num_kv_heads, rows_per_block, head_dim]: K at 0, V at 1."""
        return self.data[index]

    def copy_blocks(self, pairs) -> None:
        """Copies every layer's K and V of block src into block dst, for each (src, dst) pair, in one op."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.data.device)
        data = self.data.view(torch.uint8) if self.spec.element_size == 1 else self.data  # float8: as bytes
        data[:, :, dst] = data[:, :, src]  # a quantized block's scales are inside it: they are copied too


def store_memory_of(kv_agent: object, device: torch.device | str) -> Callable[[int], tuple[np.ndarray, object]] | None:
    """Where a KV transfer agent factory wants a rank's CPU KV store (PagedKVCache's host_memory): what its
    store_memory(device) returns, if it has that method (kv_transfer/agent_factory.py); else None."""
    offer = getattr(kv_agent, "store_memory", None)
    return offer(torch.device(device)) if offer is not None else None
