"""Paged decode attention in Triton, split-K (flash-decoding): one query token per sequence reads its KV straight
from the paged cache through its block table, with no gather into contiguous tensors.

Layout (the engine's own, see torch_ref.py): one layer's cache is [2, num_blocks, Hk, block_size, D], K at 0 and V
at 1. A program handles one (sequence, KV head, split): the split is a run of the sequence's blocks; the KV head's
whole group of query heads is computed together, so each K/V tile is loaded once for the group (GQA/MQA). Each
split leaves a partial softmax (running max m, sum l) and an unnormalised output; a second kernel combines the
splits. Splits let a few long sequences use the whole device; with many sequences one split each suffices.

A program walks its split BLOCK_N tokens at a time, finding each token's KV block through the block table, so a
tile may span several KV blocks. Compiled, 16-bit tiles are multiplied as they are (native_dot) and the tile shape
and pipelining depth are chosen by timing a few configurations on the GPU at hand (triton.autotune, per shape
class); float32, mixed dtypes and the interpreter widen tiles to float32 and use the input precision
dot_precision() picks (the prefill kernel shares these helpers). The softmax runs in base 2 (exp2), the scale
folded with log2(e).

A quantized cache (int8 / fp8_e4m3 codes, a float32 scale per block and KV head in the block's extra row:
kv_quant.py) is read the same way: each key's codes are loaded with its block's scale, and the tile is widened
to float32 times the scale before the products, so the kernels never see a value that was not scaled.

Triton is imported here only; the engine imports this module only when the Triton backend is chosen. On the CPU
the kernels run under TRITON_INTERPRET=1 (tests), which must be set before this module is imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.engine.attention.kv_quant import is_quantized, scales_of
from tandem.engine.kv.kv_cache import scale_rows

MIN_DOT = 16  # tl.dot needs at least 16 rows: a KV head's query group is padded up to this
TENSOR_CORE_PRECISION = "tf32"  # Triton's own default for float32 tl.dot on NVIDIA tensor cores
# Under Triton's CPU interpreter (tests) the kernels run one small configuration with float32 tiles; compiled, they
# multiply 16-bit tiles as they are and choose among a few tile shapes by timing them (triton.autotune).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634  # scores are scaled into base 2 once, so the softmax runs on exp2


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input_precision for attention over q and a cache of this dtype where the kernels widen tiles to
    float32 (the interpreter; mixed dtypes; float32 itself: see native_dot). The kernels pass
    torch.promote_types(q.dtype, kv.dtype).

    float32: "ieee", true float32 products. Triton's GPU default (TF32) keeps 10 mantissa bits and puts float32
    results off the reference by ~1e-3; the interpreter always multiplies in float32 whatever the precision, so
    only a GPU shows the difference.
    bfloat16, float16: TENSOR_CORE_PRECISION. Their values are exact in TF32, so Q.K^T loses nothing on the
    tensor cores; only P (the softmax weights) is cut to 10 mantissa bits, well inside 16-bit tolerance.

    Raises ValueError for any other dtype."""
    if dtype == torch.float32:
        return "ieee"
    if dtype in (torch.bfloat16, torch.float16):
        return TENSOR_CORE_PRECISION
    raise ValueError(f"the Triton attention kernels take float32, bfloat16 or float16 tensors, got {dtype}")


def native_dot(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the kernels multiply the tiles in their own 16-bit dtype (tensor-core products summed in float32,
    the softmax weights P rounded to that dtype before P.V, as FlashAttention does): compiled kernels with q and
    the cache both bfloat16 or both float16. Widening 16-bit tiles to float32 instead runs the tensor cores at
    TF32, about half their 16-bit rate (measured on an H200: prefill at 5.5% of the bf16 matmul rate)."""
    return not INTERPRETED and q_dtype == kv_dtype and q_dtype in (torch.bfloat16, torch.float16)


def quick_bench(fn, quantiles=None):
    """triton.autotune's timer, shortened (3 ms warm-up, 15 ms of runs per configuration): tuning is part of an
    engine's start (TritonAttentionBackend.tune), which should stay short."""
    return triton.testing.do_bench(fn, warmup=3, rep=15, quantiles=quantiles)


def tuned(configs: list[triton.Config], interpreted: triton.Config, key: list[str], prune=None):
    """triton.autotune over `configs` keyed by `key` (and the arguments' dtypes), or the one `interpreted`
    configuration under the interpreter. prune: triton's early_config_prune (configs, positional args, **keyword
    args) -> the configs worth timing for this call's variant. The keys hold the model's shape only (heads,
    head_dim, block size), not the batch: a kernel is timed once per model, at the engine's start
    (TritonAttentionBackend.tune), on one representative batch, never on a request (re-timing as batches and
    contexts grow stalled steps by 100 ms and more on an H200)."""
    configs = [interpreted] if INTERPRETED else configs
    pruning = {"prune_configs_by": {"early_config_prune": prune}} if prune else {}
    try:  # cache_results: the choice is kept in Triton's cache folder, so a later start on this GPU reads it
        return triton.autotune(configs=configs, key=key, do_bench=quick_bench, cache_results=True, **pruning)
    except TypeError:  # a Triton whose autotune takes warmup/rep rather than a timer
        return triton.autotune(configs=configs, key=key, warmup=3, rep=15, **pruning)


@triton.jit
def load_keys(head_base, table_row, tok, tok_ok, dims, stride_kv_kv, stride_kv_b, stride_kv_s, scale_base,
              stride_sc_kv, stride_sc_b, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr):
    """K and V [len(tok), HEAD_DIM] of the keys at positions tok (zeros where not tok_ok), each found through the
    sequence's block table (table_row), so a tile may span KV blocks. QUANTIZED: the codes times their block's
    scale (scale_base: this KV head's scales), in float32. Shared by both kernels."""
    block = tl.load(table_row + tok // BLOCK_SIZE, mask=tok_ok, other=0)
    offsets = block[:, None] * stride_kv_b + (tok % BLOCK_SIZE)[:, None] * stride_kv_s + dims[None, :]
    k = tl.load(head_base + offsets, mask=tok_ok[:, None], other=0.0)
    v = tl.load(head_base + stride_kv_kv + offsets, mask=tok_ok[:, None], other=0.0)
    if QUANTIZED:
        k_scale = tl.load(scale_base + block * stride_sc_b, mask=tok_ok, other=0.0)
        v_scale = tl.load(scale_base + stride_sc_kv + block * stride_sc_b, mask=tok_ok, other=0.0)
        k = k.to(tl.float32) * k_scale[:, None]
        v = v.to(tl.float32) * v_scale[:, None]
    return k, v


@triton.jit
def key_scores(q, k, scale_log2, NATIVE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q . k^T, scaled into base 2: [rows, keys]. One return after an if/else: Triton's compiler goes on past a
    return inside a constexpr branch, so an early return would also build the other product (bf16 against a
    float32 tile: a compilation error on the GPU that the interpreter, running plain Python, never shows)."""
    if NATIVE_DOT:
        scores = tl.dot(q, tl.trans(k))
    else:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
    return scores * scale_log2


@triton.jit
def online_softmax_step(scores, v, m, l, acc, NATIVE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of keys folded into the running max m, sum l and output acc (hidden keys' scores are -inf); a
    fully hidden tile contributes nothing. Returns the new (m, l, acc)."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    if NATIVE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    return m_new, l, acc


_DECODE_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                   for n, w, st in ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 2, 4))]


@tuned(_DECODE_CONFIGS, triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1),
       key=["GROUP_PAD", "HEAD_DIM", "BLOCK_SIZE"])
@triton.jit
def _split_kernel(q_ptr, kv_ptr, tables_ptr, lens_ptr, part_out_ptr, part_m_ptr, part_l_ptr, scales_ptr,
                  scale_log2, window,
                  stride_q_t, stride_q_h,
                  stride_kv_kv, stride_kv_b, stride_kv_h, stride_kv_s,
                  stride_sc_kv, stride_sc_b, stride_sc_h,
                  stride_tab,
                  num_splits, blocks_per_split,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    q_heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_q_t + q_heads[:, None] * stride_q_h + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    # This split's tokens: its run of blocks, cut at the sequence's end; BLOCK_N of them per step, each found
    # through the block table on its own (a tile may span several KV blocks, or part of one).
    lo = split * blocks_per_split * BLOCK_SIZE
    hi = tl.minimum(lo + blocks_per_split * BLOCK_SIZE, seq_len)
    query_pos = seq_len - 1
    if HAS_WINDOW:
        lo = tl.maximum(lo, (query_pos - window + 1) // BLOCK_N * BLOCK_N)
    head_base = kv_ptr + kv_head * stride_kv_h
    for start in range(lo, hi, BLOCK_N):
        tok = start + cols
        tok_ok = tok < hi
        k, v = load_keys(head_base, tables_ptr + seq * stride_tab, tok, tok_ok, dims, stride_kv_kv, stride_kv_b,
                         stride_kv_s, scales_ptr + kv_head * stride_sc_h, stride_sc_kv, stride_sc_b, BLOCK_SIZE,
                         QUANTIZED)
        scores = key_scores(q, k, scale_log2, NATIVE_DOT, DOT_PRECISION)  # [GROUP_PAD, BLOCK_N]
        visible = tok_ok
        if HAS_WINDOW:
            visible = visible & (query_pos - tok < window)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m, l, acc = online_softmax_step(scores, v, m, l, acc, NATIVE_DOT, DOT_PRECISION)

    part = (seq * tl.num_programs(1) + kv_head) * num_splits + split
    tl.store(part_m_ptr + part * GROUP_PAD + rows, m)
    tl.store(part_l_ptr + part * GROUP_PAD + rows, l)
    tl.store(part_out_ptr + (part * GROUP_PAD + rows[:, None]) * HEAD_DIM + dims[None, :], acc)


@triton.jit
def _combine_kernel(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_o_t, stride_o_h, num_splits,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = head % GROUP
    splits = tl.arange(0, SPLITS_PAD)
    ok = splits < num_splits
    part = (seq * (tl.num_programs(1) // GROUP) + kv_head) * num_splits + splits
    m = tl.load(part_m_ptr + part * GROUP_PAD + row, mask=ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part * GROUP_PAD + row, mask=ok, other=0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_out_ptr + (part[:, None] * GROUP_PAD + row) * HEAD_DIM + dims[None, :], mask=ok[:, None],
                  other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # m is in base 2 (scores scaled by LOG2E)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + seq * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty))


def check_paged_shapes(q: torch.Tensor, kv: torch.Tensor) -> tuple[int, int, int, int]:
    """(query heads, KV heads, head_dim, block_size) of q [tokens, Hq, D] and a layer's cache [2, blocks, Hk,
    block_size (+ 1 quantized), D]. Raises ValueError for shapes the kernels do not take."""
    _, hq, d = q.shape
    _, _, hk, rows, d_kv = kv.shape
    block_size = rows - scale_rows(kv.dtype)
    if d != d_kv or hq % hk:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(kv.shape)}")
    if d & (d - 1) or block_size & (block_size - 1):
        raise ValueError(f"head_dim ({d}) and block_size ({block_size}) must be powers of two")
    if kv.stride(4) != 1 or q.stride(2) != 1:
        raise ValueError("q and the cache must be contiguous in their last dimension")
    return hq, hk, d, block_size


def choose_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, *, target_programs: int = 256,
                  min_blocks_per_split: int = 4) -> int:
    """Splits per sequence: enough programs to fill the device when sequences are few and long, none when the
    batch already fills it or contexts are short."""
    if max_blocks <= min_blocks_per_split:
        return 1
    wanted = triton.cdiv(target_programs, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max_blocks, min_blocks_per_split)))


def scale_args(kv: torch.Tensor) -> tuple[torch.Tensor, int, int, int, bool]:
    """What the kernels take for a quantized cache's scales: the float32 scales [2, blocks, Hk] and their strides
    (K/V, block, head), and QUANTIZED; for a float cache the cache itself stands in, unread."""
    if not is_quantized(kv):
        return kv, 0, 0, 0, False
    scales = scales_of(kv)
    return (scales, *scales.stride(), True)


def kernel_dtypes(q: torch.Tensor, kv: torch.Tensor) -> tuple[bool, str]:
    """NATIVE_DOT and DOT_PRECISION for q against this cache (a quantized cache's values are float32 tiles)."""
    if is_quantized(kv):
        return False, dot_precision(q.dtype)
    return native_dot(q.dtype, kv.dtype), dot_precision(torch.promote_types(q.dtype, kv.dtype))


def paged_decode_attention(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, window: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one query token per sequence (at position seq_lens[b] - 1); kv: one layer's cache
    [2, num_blocks, Hk, block_size, D]; block_tables: [B, max_blocks] int; seq_lens: [B] int (>= 1). Returns
    [B, Hq, D] in q's dtype. D and block_size must be powers of two; Hq a multiple of Hk; q and kv float32,
    bfloat16 or float16, or kv an int8 / fp8_e4m3 cache with its scale rows (kv_quant.py). Raises ValueError
    otherwise."""
    b = q.shape[0]
    hq, hk, d, block_size = check_paged_shapes(q, kv)
    group = hq // hk
    group_pad = max(MIN_DOT, triton.next_power_of_2(group))
    max_blocks = block_tables.shape[1]
    splits = num_splits or choose_splits(b, hk, max_blocks)
    blocks_per_split = triton.cdiv(max_blocks, splits)
    parts = b * hk * splits * group_pad
    part_out = torch.empty(parts * d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_l = torch.empty(parts, dtype=torch.float32, device=q.device)
    tables, lens = block_tables, seq_lens  # the engine's own int64 tensors, read as they are
    scales, sc_kv, sc_b, sc_h, quantized = scale_args(kv)
    native, precision = kernel_dtypes(q, kv)
    _split_kernel[(b, hk, splits)](
        q, kv, tables, lens, part_out, part_m, part_l, scales, scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), sc_kv, sc_b, sc_h,
        tables.stride(0), splits, blocks_per_split,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=block_size, HAS_WINDOW=window is not None,
        NATIVE_DOT=native, DOT_PRECISION=precision, QUANTIZED=quantized)
    out = torch.empty_like(q)
    _combine_kernel[(b, hq)](part_out, part_m, part_l, out, out.stride(0), out.stride(1), splits,
                             GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d,
                             SPLITS_PAD=triton.next_power_of_2(splits))
    return out
