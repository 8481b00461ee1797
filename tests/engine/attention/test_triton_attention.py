"""The Triton attention kernels against the torch reference backend, on random inputs, run on the CPU by Triton's
interpreter (TRITON_INTERPRET=1, set in tests/conftest.py when there is no GPU): paged decode with split-K and
paged prefill over cached context, across block sizes, head dims, GQA ratios, unaligned context lengths,
scattered and shared block ids, mixed batches and sliding windows."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.attention.triton_backend import TritonAttentionBackend, select_backend
from tandem.engine.attention.triton_decode import choose_splits, paged_decode_attention

HK = 2  # KV heads; query heads = HK * group


def random_batch(query_lens, computed, block_size, head_dim, group, dtype=torch.float32, seed=0):
    """A cache with the batch's blocks scattered over it (a random permutation) and the first block of the longest
    sequence shared with the last one when both have a full cached block (a shared prefix), plus the step's
    q/k/v."""
    g = torch.Generator().manual_seed(seed)
    totals = [q + c for q, c in zip(query_lens, computed)]
    needed = [-(-t // block_size) for t in totals]
    num_blocks = sum(needed) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in needed:
        tables.append(perm[i:i + n])
        i += n
    longest = max(range(len(totals)), key=totals.__getitem__)
    if longest != len(tables) - 1 and computed[-1] >= block_size and computed[longest] >= block_size:
        tables[-1][0] = tables[longest][0]
    kv = torch.randn(2, num_blocks, HK, block_size, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata.build(query_lens, computed, tables, block_size, torch.device("cpu"))
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype) for h in (HK * group, HK, HK))
    return kv, meta, q, k, v


def compare(query_lens, computed, block_size, head_dim, group, window=None, dtype=torch.float32):
    kv, meta, q, k, v = random_batch(query_lens, computed, block_size, head_dim, group, dtype)
    scale = head_dim ** -0.5
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kv.float().clone(), meta, scale, window)
    kv_triton = kv.clone()
    out = TritonAttentionBackend().forward(q, k, v, kv_triton, meta, scale, window)
    # both backends wrote the new tokens' K/V into the same slots
    assert torch.equal(kv_triton.float(), _written(kv.float(), k.float(), v.float(), meta))
    return out.float(), ref


def _written(kv, k, v, meta):
    copy = kv.clone()
    TorchAttentionBackend().write_kv(k, v, copy, meta)
    return copy


def relative_error(out, ref) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


DECODE_LENS = [1, 15, 17, 130, 2000, 33]  # unaligned to blocks, one long sequence among short ones
# Query heads per KV head x head_dim x block size. `make test` runs four shapes that hold every group, and every
# head_dim with every block size; the other twelve of the grid are its slow variants (`make test-all`).
GRID = [(group, head_dim, block) for group in (1, 3, 4, 8) for head_dim in (64, 128) for block in (16, 32)]
COVERING = {(1, 64, 16), (3, 128, 32), (4, 128, 16), (8, 64, 32)}
SHAPES = [pytest.param(*shape, marks=() if shape in COVERING else pytest.mark.slow,
                       id=f"group{shape[0]}-dim{shape[1]}-block{shape[2]}") for shape in GRID]


@pytest.mark.parametrize("group, head_dim, block_size", SHAPES)
def test_decode_matches_the_reference(block_size, head_dim, group):
    out, ref = compare([1] * len(DECODE_LENS), [n - 1 for n in DECODE_LENS], block_size, head_dim, group)
    assert relative_error(out, ref) <= 1e-4


@pytest.mark.parametrize("splits", [1, 2, 7, 40])
def test_decode_split_k_gives_the_same_result_for_any_split(splits):
    kv, meta, q, k, v = random_batch([1, 1], [999, 40], 16, 64, 4)
    TorchAttentionBackend().write_kv(k, v, kv, meta)
    one = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens_tensor, 0.125, num_splits=1)
    out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens_tensor, 0.125, num_splits=splits)
    assert relative_error(out, one) <= 1e-5


def test_split_choice_fills_the_device_only_when_the_batch_does_not():
    assert choose_splits(num_seqs=1, num_kv_heads=8, max_blocks=256) > 1  # one long sequence: split it
    assert choose_splits(num_seqs=64, num_kv_heads=8, max_blocks=256) == 1  # 512 programs already
    assert choose_splits(num_seqs=1, num_kv_heads=8, max_blocks=3) == 1  # short context: nothing to split


@pytest.mark.parametrize("group, head_dim, block_size", SHAPES)
def test_prefill_chunks_over_cached_context_match_the_reference(block_size, head_dim, group):
    # a fresh prompt, a chunk after 70 cached tokens, a decode mixed in, a chunk after a long cached prefix
    out, ref = compare([37, 20, 1, 45], [0, 70, 99, 300], block_size, head_dim, group)
    assert relative_error(out, ref) <= 1e-4


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_sliding_window(mode):
    lens, done = ([1, 1], [200, 30]) if mode == "decode" else ([50, 9], [80, 0])
    out, ref = compare(lens, done, 16, 64, 3, window=24)
    assert relative_error(out, ref) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_half_precision_caches(dtype, mode):
    lens, done = ([1, 1, 1], [300, 17, 0]) if mode == "decode" else ([40, 1], [33, 64])
    out, ref = compare(lens, done, 16, 64, 4, dtype=dtype)
    assert relative_error(out, ref) <= (2e-3 if dtype is torch.float16 else 2e-2)


def test_shared_blocks_are_exercised():
    _, meta, *_ = random_batch([1] * len(DECODE_LENS), [n - 1 for n in DECODE_LENS], 32, 64, 1)
    assert meta.block_tables[-1, 0] == meta.block_tables[4, 0]  # the 2,000-token sequence's first block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_compiled_kernels_on_the_gpu(mode, dtype, tolerance):
    # float32 holds 1e-4 only because the kernels multiply float32 at IEEE precision (Triton's GPU default, TF32,
    # is ~1e-3 off); bfloat16 runs on the tensor cores.
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 is set on a GPU machine; unset it to test the compiled kernels")
    cuda = torch.device("cuda")
    lens, done = ([1] * 64, [4095] * 64) if mode == "decode" else ([8192], [0])
    kv, meta, q, k, v = random_batch(lens, done, 16, 128, 4, dtype)
    meta = AttentionMetadata.build(lens, done, meta.block_tables.tolist(), 16, cuda)
    kv, q, k, v = (x.to(cuda) for x in (kv, q, k, v))
    scale = 128 ** -0.5
    # the reference in float64 on the same device: free of TF32 whatever torch's matmul settings are
    ref = TorchAttentionBackend().forward(q.double(), k.double(), v.double(), kv.double(), meta, scale)
    out = TritonAttentionBackend().forward(q, k, v, kv.clone(), meta, scale)
    assert out.dtype == dtype and out.device.type == "cuda"
    assert relative_error(out.double(), ref) <= tolerance


def test_backend_selection():
    # the decision itself (auto on CUDA, import errors, the log line) is tested in test_attention_backend.py
    assert type(select_backend("auto", torch.device("cpu"), log=False)) is TorchAttentionBackend
    assert type(select_backend("torch", torch.device("cuda"), log=False)) is TorchAttentionBackend
    triton = select_backend("triton", torch.device("cpu"), log=False)  # the interpreter, as these tests run it
    assert type(triton) is TritonAttentionBackend and triton.choice.name == "triton"
    with pytest.raises(ValueError, match="attention backend"):
        select_backend("flash", torch.device("cpu"))


@pytest.mark.parametrize("model", ["tiny_llama", pytest.param("embedded", marks=pytest.mark.slow)])
def test_engine_with_the_triton_backend_gives_the_reference_tokens(model, request):
    """The engine's path through the Triton backend (prefill, then decode over the paged cache) on the tiny Llama
    3 (grouped queries, 3 layers); the embedded model's 30 layers cost a minute under the interpreter, so that
    variant is in `make test-all`."""
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.sampling_params import SamplingParams
    from tests.engine.engine_helpers import run_all

    loaded = request.getfixturevalue(model)
    prompts = [loaded.tokenizer.encode("The capital of France is"),
               loaded.tokenizer.encode_chat([{"role": "user", "content": "Name a color."}])]
    # Two decode steps after the prefill cover both kernels; each step costs seconds under the interpreter.
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    results = {}
    try:
        for backend in ("torch", "triton"):
            engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=32, max_model_len=256, attention_backend=backend))
            assert type(loaded.model.attention).__name__ == {"torch": "TorchAttentionBackend",
                                                              "triton": "TritonAttentionBackend"}[backend]
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            results[backend] = {key: out.token_ids for key, out in run_all(engine).items()}
    finally:
        loaded.model.attention = TorchAttentionBackend()  # the session-wide model goes back to the reference
    assert results["triton"] == results["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_with_residual_add(dtype, with_residual):
    import torch.nn.functional as F

    from tandem.engine.attention.triton_norm import rms_norm

    g = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(9, 576, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    out, residual = rms_norm(x, weight, 1e-5, delta if with_residual else None)
    h = x + delta if with_residual else x
    if dtype is torch.float32:
        ref = F.rms_norm(h, (576,), weight, 1e-5)
        assert torch.allclose(residual, h) and relative_error(out, ref) <= 1e-5
    else:  # the interpreter rounds bfloat16 casts towards zero (a GPU rounds to nearest): within 2 ulps
        ref = weight * F.rms_norm(h.float(), (576,), eps=1e-5).to(dtype)
        assert torch.allclose(residual.float(), h.float(), rtol=2 ** -6)
        assert relative_error(out.float(), ref.float()) <= 2e-2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_matches_the_model_tables(head_dim):
    from tandem.engine.attention.triton_norm import rotary_
    from tandem.engine.model_config import RopeConfig
    from tandem.engine.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(RopeConfig(rope_type="llama3", factor=8.0, original_max_position_embeddings=64),
                           head_dim, 4096, torch.float32, torch.device("cpu"))
    qkv = torch.randn(6, 14, head_dim)
    positions = torch.tensor([0, 1, 63, 64, 1000, 4095])
    qk = qkv[:, :10]  # Q and K heads of a fused projection: a strided view, rotated in place
    cos, sin = rope.lookup(positions)
    expected = rope.rotate(qk, cos, sin)
    untouched = qkv[:, 10:].clone()
    rotary_(qk, positions, rope.cos, rope.signed_sin)
    assert relative_error(qkv[:, :10], expected) <= 1e-5
    assert torch.equal(qkv[:, 10:], untouched)  # V is left alone


def test_tuning_runs_both_kernels_on_the_model_shape_and_says_what_it_chose():
    """What an engine on CUDA runs at start-up (tune_for), here on the interpreter's one configuration: both
    kernels, with and without a sliding window, on a batch of the model's shape."""
    chosen = TritonAttentionBackend().tune(6, 2, 64, 16, torch.float32, torch.device("cpu"), {None, 8}, batch=2,
                                           context=40)
    assert chosen.startswith("attention kernels tuned in ")
    assert "decode BLOCK_N: 32," in chosen and "prefill BLOCK_M: 16, BLOCK_N: 32," in chosen


def test_float32_tiles_are_tuned_over_narrow_configurations_only():
    """The compiled prefill kernel times every tile shape for 16-bit products, and only tiles of up to
    FLOAT32_TILE scores where it widens them to float32 (float32 models, quantized caches)."""
    from tandem.engine.attention.triton_prefill import _CONFIGS, FLOAT32_TILE, float32_tiles

    assert float32_tiles(_CONFIGS, {}, NATIVE_DOT=True) == _CONFIGS
    narrow = float32_tiles(_CONFIGS, {}, NATIVE_DOT=False)
    assert narrow and len(narrow) < len(_CONFIGS)
    assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= FLOAT32_TILE for c in narrow)
