"""tandem's C++ CPU kernels (engine/hardware/csrc/, loaded by engine/hardware/cpu_kernels.py): built at install on
every x86-64 machine; the Q4_1 and Q8_0 integer-dot products on every path this CPU has (plain C++, AVX2, AVX-512
VNNI) equal the exact products of the blocks' weights with the activations as the kernels quantize them; the
packing into interleaved groups is exact (a GGUF Q8_0 tensor gives its own codes back); the paged decode attention
equals softmax attention over the blocks, read in place, on every path; bad arguments are refused with a message;
and TANDEM_CPU_DISABLE takes the AVX-512 path, or all of them, away."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
import torch

from tandem.engine.attention import cpu_decode
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.hardware import int_dot
from tandem.engine.hardware.cpu_features import cpu_features
from tandem.engine.hardware.cpu_kernels import PATHS, kernel_path, library_error, supported_paths

X86_LINUX = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def test_the_kernels_are_built_and_their_paths_probed_on_x86_64():
    if not X86_LINUX:
        pytest.skip(f"the kernels' fast paths are x86-64 ones; this is {platform.machine()}")
    assert library_error() is None  # setup.py builds them at install: a missing one is a broken install
    here = cpu_features()
    assert "scalar" in supported_paths() and ("avx2" in supported_paths()) == ("avx2" in here.flags)
    assert here.cpu_kernels == ("avx2" in here.flags)
    assert here.cpu_kernels_avx512 == ("avx512_vnni" in supported_paths())


PATH_NAMES = ["scalar", "avx2", "avx512_vnni"]


def path_number(name: str) -> int:
    if name not in supported_paths():
        pytest.skip(f"this CPU has no {name} path")
    return PATHS[name]


def q4_1_case(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) / 8 + 0.01
    offset = torch.rand(n, k // 32, generator=g) - 0.5
    weight = codes.float() * scale.half().float().repeat_interleave(32, 1) + \
        offset.half().float().repeat_interleave(32, 1)
    return int_dot.q4_1_blocks(codes, scale, offset), weight


def quantized(x: torch.Tensor, wide: bool = False) -> torch.Tensor:
    codes, scale = int_dot.quantize_rows(x, wide=wide)
    return (codes.float().view(x.shape[0], -1, 32) * scale[..., None]).view(x.shape)


@pytest.mark.parametrize("path", PATH_NAMES)
@pytest.mark.parametrize("wide", [False, True], ids=["int8", "int16"])
@pytest.mark.parametrize("n, k", [(61, 96), (960, 576)])  # 61: a last group of 8 rows padded
@pytest.mark.parametrize("m", [1, 4, 9])  # 9: two passes of four activation rows and one of one
def test_q4_1_products_are_the_exact_products_of_the_quantized_activations(path, wide, n, k, m):
    blocks, weight = q4_1_case(n, k, seed=n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expected = quantized(x, wide).double() @ weight.double().t()
    out = int_dot.q4_1_linear(x, blocks, n, path_number(path), wide=wide)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    # bfloat16 activations: the same products, the output rounded to bfloat16
    low = int_dot.q4_1_linear(x.bfloat16(), blocks, n, path_number(path), wide=wide)
    reference = quantized(x.bfloat16().float(), wide).double() @ weight.double().t()
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), reference, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", PATH_NAMES)
@pytest.mark.parametrize("m", [1, 6])
def test_q8_0_products_are_the_exact_products_of_the_quantized_activations(path, m):
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(203, 160, generator=g)
    blocks = int_dot.q8_0_blocks(weight)
    grouped = weight.view(203, 5, 32)
    d = (grouped.abs().amax(-1) / 127).half().float()
    as_stored = (torch.round(grouped / (grouped.abs().amax(-1, keepdim=True) / 127)) * d[..., None]).view(203, 160)
    x = torch.randn(m, 160, generator=g)
    out = int_dot.q8_0_linear(x, blocks, 203, path_number(path))
    torch.testing.assert_close(out.double(), quantized(x).double() @ as_stored.double().t(), rtol=1e-5, atol=1e-4)


def test_a_gguf_q8_0_tensor_gives_its_own_codes_and_scales_back():
    """The embedded model's token embedding is Q8_0: the head's blocks, made from its dequantized values, hold
    the file's very codes and fp16 scales (read as stored, not re-rounded)."""
    from gguf import GGMLQuantizationType

    from tandem.engine.loader import default_model_path, load_checkpoint
    from tandem.engine.loader.gguf_index import open_gguf

    index = open_gguf(default_model_path())
    [info] = [t for t in index.tensors if t.name == "token_embd.weight"]
    assert GGMLQuantizationType(info.tensor_type) == GGMLQuantizationType.Q8_0
    raw = np.ascontiguousarray(index.data(info)).reshape(-1, 34)[:8 * 18]  # the first 8 rows of 576: 18 blocks each
    embedding = load_checkpoint(progress=False).weights["model.embed_tokens.weight"]
    assert embedding.stored == "Q8_0"  # so the loader lets a packed model's LM head stay Q8_0
    rows = embedding.read(range(0, 8), dtype=torch.float32, device="cpu")
    blocks = int_dot.q8_0_blocks(rows).view(1, 18, 272)  # one group of 8 rows
    stored = torch.from_numpy(raw.copy()).view(8, 18, 34)
    assert torch.equal(blocks[0, :, :16].reshape(18, 8, 2).transpose(0, 1), stored[..., :2])  # the fp16 scales
    codes = blocks[0, :, 16:].reshape(18, 8, 8, 4).permute(2, 0, 1, 3).reshape(8, 18, 32)  # [row, block, weight]
    assert torch.equal(codes, stored[..., 2:])


def test_bad_arguments_are_refused_with_a_message():
    blocks, _ = q4_1_case(16, 64, seed=0)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        torch.ops.tandem_cpu.q4_1_linear(torch.randn(1, 48), blocks, 16, 0)
    with pytest.raises(RuntimeError, match="a group of 8 rows of 96 weights takes"):
        torch.ops.tandem_cpu.q4_1_linear(torch.randn(1, 96), blocks, 16, 0)
    with pytest.raises(RuntimeError, match="cannot hold 17 rows"):
        torch.ops.tandem_cpu.q4_1_linear(torch.randn(1, 64), blocks, 17, 0)
    with pytest.raises(RuntimeError, match="unknown path 9"):
        torch.ops.tandem_cpu.q4_1_linear(torch.randn(1, 64), blocks, 16, 9)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tandem_cpu.q8_0_linear(torch.randn(1, 64).half(), int_dot.q8_0_blocks(torch.randn(8, 64)), 8, 0)
    with pytest.raises(ValueError, match="K divisible by 32"):
        int_dot.q8_0_blocks(torch.randn(8, 40))


def test_blocks_held_by_handle_give_the_same_products_and_go_when_their_projection_does():
    """BlockLinear registers its blocks with the kernels (a compiled graph then passes an int, not the weight) and
    gives them back when it is collected; a handle given back is refused."""
    import gc

    from tandem.engine.models.block_linear import BlockLinear
    from tandem.engine.models.int4 import Int4Weight

    if library_error() is not None:
        pytest.skip(library_error())
    g = torch.Generator().manual_seed(3)
    weight = Int4Weight(torch.randint(0, 16, (24, 64), dtype=torch.uint8, generator=g),
                        torch.rand(24, 2, generator=g) / 8, torch.rand(24, 2, generator=g))
    x = torch.randn(2, 64, generator=g)
    projection = BlockLinear.q4_1(weight, None)
    direct = int_dot.q4_1_linear(x, projection.blocks, 24)
    assert torch.equal(projection(x), direct)
    handle = projection.handle
    del projection
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no blocks are held under handle {handle}"):
        torch.ops.tandem_cpu.block_project(x, handle, 24, 0, 0)
    again = BlockLinear.q4_1(weight, None)
    assert again.handle == handle  # the freed slot is reused
    assert torch.equal(again(x), direct)


def dense_decode(q, kv, table, length, window):
    """One sequence's decode attention by softmax over its blocks' first `length` positions (within window)."""
    hk, d = kv.shape[2], kv.shape[4]
    keys, values = (kv[j][table].transpose(0, 1).reshape(hk, -1, d)[:, :length].float() for j in (0, 1))
    first = 0 if window is None else max(0, length - window)
    keys, values = keys[:, first:], values[:, first:]
    grouped = q.float().view(hk, -1, d)
    weights = torch.softmax(grouped @ keys.transpose(1, 2) * d ** -0.5, dim=-1)
    return (weights @ values).reshape(-1, d)


@pytest.mark.parametrize("path", PATH_NAMES)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)], ids=["f32", "bf16", "bf16-cache-f32-q"])
@pytest.mark.parametrize("head_dim, group", [(64, 3), (128, 1), (48, 4)])  # 48: the loop without a fixed size
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_attention_matches_softmax_over_the_blocks(path, dtypes, head_dim, group, window):
    cache_dtype, q_dtype = dtypes
    g = torch.Generator().manual_seed(head_dim + group)
    lengths, bs, hk = [1, 21, 9], 4, 2
    tables = [[3 * i + j for j in range(-(-n // bs))][::-1] for i, n in enumerate(lengths)]  # blocks out of order
    kv = torch.randn(2, 3 * 6, hk, bs, head_dim, generator=g).to(cache_dtype)
    meta = AttentionMetadata.build([1] * 3, [n - 1 for n in lengths], tables, bs, torch.device("cpu"))
    q = torch.randn(3, hk * group, head_dim, generator=g).to(q_dtype)
    k, v = (torch.randn(3, hk, head_dim, generator=g).to(q_dtype) for _ in range(2))
    assert cpu_decode.supports(q.dtype, kv)
    out = cpu_decode.paged_decode(q, k, v, kv, meta, head_dim ** -0.5, window, path_number(path))
    slot = meta.slot_mapping
    for i, n in enumerate(lengths):  # the new K and V were written first, then read
        block, offset = int(slot[i]) // bs, int(slot[i]) % bs
        assert torch.equal(kv[0, block, :, offset], k[i].to(cache_dtype))
        assert torch.equal(kv[1, block, :, offset], v[i].to(cache_dtype))
        expected = dense_decode(q[i], kv, tables[i], n, window)
        tolerance = 1e-5 if cache_dtype == q_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].float(), expected, rtol=tolerance, atol=tolerance)
    assert out.dtype == q_dtype


def test_the_probe_takes_paths_away_as_tandem_cpu_disable_says(monkeypatch):
    here = cpu_features()
    if not here.cpu_kernels_avx512:
        pytest.skip("this CPU has no AVX-512 VNNI path to take away")
    assert kernel_path(here) == PATHS["avx512_vnni"]
    assert kernel_path(here.without(["cpu_kernels_avx512"], "test")) == PATHS["avx2"]
    assert kernel_path(here.without(["cpu_kernels"], "test")) is None
