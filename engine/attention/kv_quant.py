"""Quantized KV pages: int8 or fp8_e4m3 codes with one float32 scale per (layer, K/V, block, KV head).

A layer's quantized cache is [2, num_blocks, Hk, block_size + 1, D] (engine/kv/kv_cache.py): block_size rows of codes
and a scale row whose first four bytes hold the float32 scale; a value is code * scale.

Scales come from the data. Tokens reach a block one step at a time (a prefill chunk, then one or a few per
decode step), so a block's scale is the largest |value| written to it so far over the largest code:
  - a block whose first slot is written in this step starts over: its scale is that of the values written now
    (whatever an earlier owner left in it is not looked at);
  - a block that already holds tokens keeps its scale unless the new values need a larger one; then its codes are
    rescaled to the new scale (rounded once more) before the new tokens are written.
So every code fits, and no scale is ever assumed: a block of zeros gets a tiny scale, not 1.
"""

from __future__ import annotations

import torch

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.kv.kv_cache import QUANTIZED_KV

_TINY = 1e-12  # the scale of an all-zero block (its codes are zero whatever the scale)


def is_quantized(kv: torch.Tensor) -> bool:
    return kv.dtype in QUANTIZED_KV


def scales_of(kv: torch.Tensor) -> torch.Tensor:
    """The float32 scales [..., Hk] of a quantized layer cache [..., Hk, block_size + 1, D] (a view: writes to it
    write the cache)."""
    return _bytes(kv)[..., -1, :4].view(torch.float32).squeeze(-1)


def data_scales(peak: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scales that map values whose largest |value| is `peak` onto the codes of dtype: peak over the largest
    code (a tiny scale for a zero peak). The one place scales are made (the accuracy gate's test replaces it to
    prove that unit scales would fail)."""
    return (peak / QUANTIZED_KV[dtype]).clamp_min(_TINY)


def encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values already divided by their scale -> codes of `dtype` (int8 rounds to nearest and clamps to +-127;
    fp8_e4m3 clamps to its range and rounds as the conversion does)."""
    qmax = QUANTIZED_KV[dtype]
    if dtype == torch.int8:
        return torch.round(values).clamp_(-qmax, qmax).to(dtype)
    return values.clamp(-qmax, qmax).to(dtype)


def write_quantized(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
    """Stores new K/V ([T, Hk, D]) into a quantized layer cache at meta.slot_mapping, updating the blocks' scales
    (see the module docstring)."""
    bs = meta.block_size
    num_blocks, hk, d = kv.shape[1], kv.shape[2], kv.shape[4]
    slots = meta.slot_mapping
    blocks, inverse, first = meta.per_step(("kv_quant_blocks",), lambda: _written_blocks(slots, bs))
    new = torch.stack([k, v]).float()  # [2, T, Hk, D]
    largest = new.abs().amax(-1)  # [2, T, Hk]
    peak = largest.new_zeros(2, len(blocks), hk).scatter_reduce_(1, inverse[None, :, None].expand_as(largest),
                                                                  largest, "amax")
    fresh = (first == 0)[None, :, None]
    scales = scales_of(kv)  # [2, num_blocks, Hk]
    old = scales[:, blocks]
    wanted = data_scales(peak, kv.dtype)
    scale = torch.where(fresh, wanted, torch.maximum(old, wanted))
    grows = (~fresh & (scale > old)).nonzero()  # (K/V, block index, head) whose codes must be rescaled
    raw = _bytes(kv)  # indexed writes go through bytes: torch's CPU index ops skip float8
    if len(grows):
        which, index, head = grows.unbind(1)
        block = blocks[index]
        codes = kv[which, block, head, :bs].float()  # [n, bs, D]
        ratio = (old[which, index, head] / scale[which, index, head])[:, None, None]
        raw[which, block, head, :bs] = _bytes(encode(codes * ratio, kv.dtype))
    scales[:, blocks] = scale
    codes = encode(new / scale[:, inverse][..., None], kv.dtype)
    rows = meta.kv_rows(hk, num_blocks, bs + 1)
    raw.view(-1, d).index_copy_(0, rows, _bytes(codes).reshape(-1, d))


def _bytes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes as they are, float8 codes as their uint8 bits (same shape)."""
    return codes if codes.dtype == torch.int8 else codes.view(torch.uint8)


def _written_blocks(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's blocks (unique ids), each token's index among them, and the first slot written in each."""
    blocks, inverse = torch.unique(slots // block_size, return_inverse=True)
    first = torch.full((len(blocks),), block_size, dtype=slots.dtype, device=slots.device)
    first.scatter_reduce_(0, inverse, slots % block_size, "amin")
    return blocks, inverse, first


def gatherable(kv: torch.Tensor) -> torch.Tensor:
    """The cache as gathers read it: a float8 cache as its bytes (index ops on float8 are missing on some
    devices), any other as it is. dequantize_rows takes the storage dtype back."""
    return _bytes(kv) if is_quantized(kv) else kv


def dequantize_rows(gathered: torch.Tensor, block_size: int, head_dim: int, dtype: torch.dtype,
                    storage: torch.dtype) -> torch.Tensor:
    """Gathered quantized rows [..., n, (block_size + 1) * D] (n blocks, codes then the scale row; as `storage`,
    or its bytes) -> the values [..., n * block_size, D] in `dtype`."""
    shaped = gathered.view(*gathered.shape[:-1], block_size + 1, head_dim)
    # In float32, rounded once to dtype: a bfloat16 scale would be off by up to 0.4% for a whole block.
    values = shaped[..., :block_size, :].view(storage).float() * scales_of(shaped)[..., None, None]
    return values.to(dtype).view(*gathered.shape[:-2], -1, head_dim)


def convert_blocks(blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of one store's dtype [..., rows, D] (rows: block_size, plus the scale row when quantized) as a
    store of `dtype` holds them: float blocks are cast; quantized blocks are expanded by their scales; blocks
    quantized here get one scale per block and head from the largest |value| in it. A new contiguous tensor."""
    if blocks.dtype == dtype:
        return blocks.contiguous()
    if is_quantized(blocks):
        values = blocks[..., :block_size, :].float() * scales_of(blocks)[..., None, None]
    else:
        values = blocks.float()
    if dtype not in QUANTIZED_KV:
        return values.to(dtype)
    out = values.new_zeros(*values.shape[:-2], block_size + 1, values.shape[-1]).to(dtype)
    scale = data_scales(values.abs().amax(dim=(-2, -1)), dtype)
    _bytes(out)[..., :block_size, :] = _bytes(encode(values / scale[..., None, None], dtype))
    scales_of(out).copy_(scale)
    return out
