"""Quantized KV pages (engine/attention/kv_quant.py): scales come from the data as tokens are written, both
attention backends read codes times scales, and the engine's KV budget grows by the byte ratio."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.attention.kv_quant import convert_blocks, scales_of, write_quantized
from tandem.engine.attention.triton_backend import TritonAttentionBackend
from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv.kv_cache import KV_STORAGE, QUANTIZED_KV, KVCacheSpec
from tandem.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import run_all
from tests.engine.attention.test_triton_attention import random_batch, relative_error

CPU = torch.device("cpu")
QUANTIZED = [torch.int8, torch.float8_e4m3fn]
STEP = {torch.int8: 1 / 127, torch.float8_e4m3fn: 1 / 8}  # worst relative rounding of a code, of the block max


def _cache(dtype, num_blocks=4, heads=2, block_size=16, head_dim=8):
    return torch.zeros(2, num_blocks, heads, block_size + 1, head_dim, dtype=dtype)


def _write(kv, values, table, start, block_size=16):
    """values [T, 2 (K/V), heads, D] at positions start.. of a sequence whose blocks are `table`."""
    meta = AttentionMetadata.build([len(values)], [start], [table], block_size, CPU)
    write_quantized(values[:, 0], values[:, 1], kv, meta)


def _read(kv, block, block_size=16):
    """Block `block`'s values [2, heads, block_size, D] (codes times scales)."""
    return convert_blocks(kv[:, block], block_size, torch.float32)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_blocks_scale_is_its_datas_largest_value_and_codes_reconstruct_it(dtype):
    kv = _cache(dtype)
    values = torch.randn(16, 2, 2, 8) * torch.tensor([1.0, 30.0])[None, :, None, None]  # V 30x larger than K
    _write(kv, values, [2], 0)
    scales = scales_of(kv)[:, 2]  # [K/V, head]
    expected = values.abs().amax(dim=(0, 3)) / QUANTIZED_KV[dtype]  # [K/V, head]
    assert torch.allclose(scales, expected) and not torch.isclose(scales, torch.ones_like(scales)).any()
    error = (_read(kv, 2) - values.permute(1, 2, 0, 3)).abs()
    assert (error <= values.abs().amax() * STEP[dtype]).all()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_larger_token_later_grows_the_scale_and_rescales_the_codes_already_there(dtype):
    kv = _cache(dtype)
    small = torch.randn(5, 2, 2, 8)
    _write(kv, small, [1], 0)  # a prefill chunk of 5 tokens
    first = scales_of(kv)[:, 1].clone()
    big = torch.randn(1, 2, 2, 8) * 20
    _write(kv, big, [1], 5)  # the next decode step
    grown = scales_of(kv)[:, 1]
    assert (grown > first).all()
    assert torch.allclose(grown, torch.maximum(first, big.abs().amax(dim=(0, 3)) / QUANTIZED_KV[dtype]))
    got = _read(kv, 1)[:, :, :6]
    want = torch.cat([small, big]).permute(1, 2, 0, 3)
    # Earlier codes were rounded twice: within a step of the new scale (plus the first rounding).
    assert ((got - want).abs() <= 2 * grown[..., None, None] * QUANTIZED_KV[dtype] * STEP[dtype]).all()
    small_again = torch.randn(1, 2, 2, 8) * 0.01
    _write(kv, small_again, [1], 6)
    assert torch.equal(scales_of(kv)[:, 1], grown)  # a smaller token keeps the scale


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_reused_block_starts_over_from_its_new_owners_data(dtype):
    kv = _cache(dtype)
    _write(kv, torch.randn(16, 2, 2, 8) * 100, [3], 0)  # an earlier owner's large values
    fresh = torch.randn(3, 2, 2, 8)
    _write(kv, fresh, [3], 0)  # the block's first slot is written again: a new owner
    assert torch.allclose(scales_of(kv)[:, 3], fresh.abs().amax(dim=(0, 3)) / QUANTIZED_KV[dtype])


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("mode", ["decode", "short", "prefill"])
def test_the_torch_backend_reads_codes_times_scales(dtype, mode):
    """Attention over a quantized cache equals attention over a float cache holding the values its codes stand
    for, on the decode, short-query and chunked-prefill paths."""
    lens, done = {"decode": ([1, 1, 1], [40, 17, 3]), "short": ([3, 1, 5], [33, 20, 8]),
                  "prefill": ([40, 1], [33, 64])}[mode]
    kv, meta, q, k, v = random_batch(lens, done, 16, 64, 3)
    quantized = convert_blocks(kv, 16, dtype)
    out = TorchAttentionBackend().forward(q, k, v, quantized, meta, 0.125)
    values = convert_blocks(quantized, 16, torch.float32)  # after the step's writes
    ref = TorchAttentionBackend()._decode(q, values, meta, 0.125, None) if mode == "decode" else \
        TorchAttentionBackend()._short(q, values, meta, 0.125, None) if mode == "short" else \
        TorchAttentionBackend()._mixed(q, k, v, values, meta, 0.125, None)
    assert relative_error(out.reshape(ref.shape[0], -1), ref.reshape(ref.shape[0], -1)) < 1e-5


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_the_triton_kernels_read_quantized_pages_like_the_reference(dtype, mode):
    lens, done = ([1, 1, 1], [300, 17, 0]) if mode == "decode" else ([40, 1], [33, 64])
    kv, meta, q, k, v = random_batch(lens, done, 16, 64, 4)
    ref_cache, triton_cache = convert_blocks(kv, 16, dtype), convert_blocks(kv, 16, dtype)
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0.125)
    out = TritonAttentionBackend().forward(q, k, v, triton_cache, meta, 0.125)
    assert torch.equal(ref_cache.view(torch.uint8), triton_cache.view(torch.uint8))  # the same writes and scales
    assert relative_error(out, ref) < 1e-5


def test_the_kv_budget_in_blocks_grows_by_the_byte_ratio(tiny_llama):
    budget = 3 << 20
    blocks, per_block = {}, {}
    for name in ("auto", "bfloat16", "float16", "int8", "fp8_e4m3"):
        engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=name, compile=False))
        blocks[name], per_block[name] = engine.kv_cache_spec.num_blocks, engine.kv_cache_spec.bytes_per_block
        assert engine.executor.runner.kv_cache.data.dtype == (torch.float32 if name == "auto" else KV_STORAGE[name])
        engine.shutdown()
    spec = KVCacheSpec(3, 1, 16, 2, 16, torch.float32)  # tiny_llama: 3 layers, 2 KV heads of 16
    assert per_block["auto"] == spec.bytes_per_block
    assert per_block["bfloat16"] * 2 == per_block["auto"] == per_block["float16"] * 2
    assert per_block["int8"] == per_block["fp8_e4m3"] == per_block["bfloat16"] * 17 // 32  # codes + a scale row
    for name in blocks:
        assert blocks[name] == budget // per_block[name]
    assert blocks["int8"] / blocks["bfloat16"] > 1.85 and blocks["int8"] / blocks["auto"] > 3.7


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_cached_prefix_of_quantized_pages_gives_the_tokens_of_computing_it(tiny_llama, kv_dtype):
    """A prompt served again from the prefix cache reads the blocks (codes and scales) the first run left: its
    tokens are those of a run without the cache that computes the same chunks (the cached blocks' tokens, then the
    rest), bit for bit. Attention over a quantized cache always reads the stored values, the first chunk's too,
    so the cached and the computed prefix are the same values."""
    prompt = tiny_llama.tokenizer.encode("Request: the quick brown fox jumps over the lazy dog " * 5)
    assert len(prompt) > 40
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def engine(**config):
        return LLMEngine(tiny_llama, EngineConfig(kv_cache_dtype=kv_dtype, compile=False, max_model_len=256,
                                                  num_kv_blocks=64, **config))

    cached = engine()
    cached.add_request("first", prompt, params)
    run_all(cached)
    cached.add_request("again", prompt, params)
    again = run_all(cached)[("again", 0)]
    assert again.num_cached_tokens == len(prompt) // 16 * 16  # every full block of the prompt
    cached.shutdown()
    chunked = engine(enable_prefix_caching=False, max_num_batched_tokens=again.num_cached_tokens)
    chunked.add_request("computed", prompt, params)
    computed = run_all(chunked)[("computed", 0)]
    chunked.shutdown()
    assert again.token_ids == computed.token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_compiled_triton_kernels_read_quantized_pages_on_the_gpu(dtype, mode):
    """The compiled kernels (not the interpreter) over int8 / fp8 pages, against the torch reference on the same
    device over the same pages, in bfloat16 queries as an engine on a GPU runs them."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 is set on a GPU machine; unset it to test the compiled kernels")
    lens, done = ([1, 1, 1], [300, 17, 0]) if mode == "decode" else ([40, 1], [33, 64])
    kv, meta, q, k, v = random_batch(lens, done, 16, 64, 4)
    device = torch.device("cuda")
    meta = AttentionMetadata.build(lens, done, meta.block_tables.tolist(), 16, device)
    q, k, v = (t.to(device, torch.bfloat16) for t in (q, k, v))
    ref_cache, triton_cache = (convert_blocks(kv, 16, dtype).to(device) for _ in range(2))
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), ref_cache, meta, 0.125)
    out = TritonAttentionBackend().forward(q, k, v, triton_cache, meta, 0.125)
    assert relative_error(out.float(), ref) < 2e-2  # bfloat16 queries and outputs
