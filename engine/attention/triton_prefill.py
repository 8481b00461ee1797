"""Paged prefill attention in Triton, FlashAttention-style: a chunk of new query tokens per sequence attends,
causally, to the sequence's whole context read straight from the paged cache through its block table, so
chunked prefill and prefix-cached blocks need no gather. Decodes mixed into the same batch are sequences whose
chunk is one token.

The new tokens' K/V must already be in the cache (the backend writes them first). A program handles one tile of
BLOCK_M query tokens of one sequence and one query head; it walks the sequence's keys up to the tile's last
position BLOCK_N at a time (each key found through the block table, so a tile may span KV blocks) with an online
softmax in float32 (base 2): first the whole tiles of keys that every row of the tile sees, with no mask, then
the tiles along the causal diagonal (and, with a sliding window, every tile), masked. Compiled, 16-bit tiles
are multiplied as they are and BLOCK_M, BLOCK_N and the pipelining depth are chosen by timing a few
configurations on the GPU (triton.autotune; float32 tiles over the narrow ones only: float32_tiles); see
triton_decode.py for that and for the interpreter's float32 path.

Triton is imported here only; on the CPU the kernel runs under TRITON_INTERPRET=1 (set before import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.attention.triton_decode import (LOG2E, check_paged_shapes, kernel_dtypes, key_scores, load_keys,
                                                   online_softmax_step, scale_args, tuned)

_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            for m, n, w, st in ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3),
                                (64, 64, 4, 3), (64, 128, 8, 2), (64, 32, 4, 2))]
FLOAT32_TILE = 64 * 64  # the largest BLOCK_M x BLOCK_N timed where tiles are widened to float32


def float32_tiles(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The configurations worth timing (triton's early_config_prune): all of them for 16-bit products; where tiles
    are widened to float32 (a float32 model, a quantized cache: NATIVE_DOT false) only tiles of up to FLOAT32_TILE
    scores, since wider float32 tiles spill registers and each costs seconds to compile (an H200's float32 tuning
    took 125 s over all seven)."""
    if kwargs.get("NATIVE_DOT", True):
        return configs
    return [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= FLOAT32_TILE] or configs


@tuned(_CONFIGS, triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1),
       key=["GROUP", "HEAD_DIM", "BLOCK_SIZE"], prune=float32_tiles)
@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, out_ptr, tables_ptr, starts_ptr, lens_ptr, scales_ptr,
                    scale_log2, window,
                    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
                    stride_kv_kv, stride_kv_b, stride_kv_h, stride_kv_s,
                    stride_sc_kv, stride_sc_b, stride_sc_h,
                    stride_tab,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    QUANTIZED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    start = tl.load(starts_ptr + seq)
    query_len = tl.load(starts_ptr + seq + 1) - start
    seq_len = tl.load(lens_ptr + seq)
    if tile * BLOCK_M < query_len:
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < query_len
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (start + rows[:, None]) * stride_q_t + head * stride_q_h + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        query_pos = seq_len - query_len + rows  # [BLOCK_M]

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        # The keys this tile can see: up to its last row's position (causal), from its first row's window start.
        first_pos = seq_len - query_len + tile * BLOCK_M
        hi = tl.minimum(first_pos + BLOCK_M, seq_len)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
            full_hi = lo  # a window hides keys from some rows anywhere: every tile is masked
        else:  # whole tiles of keys at or before the first row's position are seen by every row: no mask
            full_hi = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, hi)
        head_base = kv_ptr + kv_head * stride_kv_h
        table_row = tables_ptr + seq * stride_tab
        scales_base = scales_ptr + kv_head * stride_sc_h
        for key_start in range(lo, full_hi, BLOCK_N):
            tok = key_start + cols
            k, v = load_keys(head_base, table_row, tok, tok < full_hi, dims, stride_kv_kv, stride_kv_b, stride_kv_s,
                             scales_base, stride_sc_kv, stride_sc_b, BLOCK_SIZE, QUANTIZED)
            scores = key_scores(q, k, scale_log2, NATIVE_DOT, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            m, l, acc = online_softmax_step(scores, v, m, l, acc, NATIVE_DOT, DOT_PRECISION)
        for key_start in range(full_hi, hi, BLOCK_N):  # the diagonal (and a window's edges): masked tiles
            tok = key_start + cols
            tok_ok = tok < hi
            k, v = load_keys(head_base, table_row, tok, tok_ok, dims, stride_kv_kv, stride_kv_b, stride_kv_s,
                             scales_base, stride_sc_kv, stride_sc_b, BLOCK_SIZE, QUANTIZED)
            scores = key_scores(q, k, scale_log2, NATIVE_DOT, DOT_PRECISION)
            visible = (tok[None, :] <= query_pos[:, None]) & tok_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (query_pos[:, None] - tok[None, :] < window)
            scores = tl.where(visible, scores, float("-inf"))
            m, l, acc = online_softmax_step(scores, v, m, l, acc, NATIVE_DOT, DOT_PRECISION)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + (start + rows[:, None]) * stride_o_t + head * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D], the batch's new tokens concatenated (sequence i owns rows query_start_loc[i]:[i+1], at
    positions seq_lens[i] - query_len .. seq_lens[i] - 1); kv: one layer's cache [2, num_blocks, Hk, block_size,
    D] already holding the new tokens' K/V; block_tables: [B, max_blocks]. Returns [T, Hq, D] in q's dtype.
    Raises ValueError for shapes or dtypes the kernel does not take (D and block_size must be powers of two; q
    and kv float32, bfloat16 or float16, or kv an int8 / fp8_e4m3 cache with its scale rows)."""
    hq, hk, d, block_size = check_paged_shapes(q, kv)
    b = block_tables.shape[0]
    out = torch.empty_like(q)
    tables, starts, lens = block_tables, query_start_loc, seq_lens  # the engine's own int64 tensors, as they are
    scales, sc_kv, sc_b, sc_h, quantized = scale_args(kv)
    native, precision = kernel_dtypes(q, kv)
    _prefill_kernel[lambda meta: (b, hq, triton.cdiv(max_query_len, meta["BLOCK_M"]))](
        q, kv, out, tables, starts, lens, scales, scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), sc_kv, sc_b, sc_h, tables.stride(0),
        GROUP=hq // hk, HEAD_DIM=d, BLOCK_SIZE=block_size, HAS_WINDOW=window is not None,
        NATIVE_DOT=native, DOT_PRECISION=precision, QUANTIZED=quantized)
    return out
