"""int8 (per output channel) and int4 (group-wise) weights for any checkpoint: the quantizers against the values
they stand for, the kernels against dense math over the dequantized weights, a Hugging Face folder built with each
format, the refusals, and the int8 kernel on an AVX2-capped CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tandem.engine.loader import load_model
from tandem.engine.models.int4 import Int4Linear, Int4Weight
from tandem.engine.models.int8 import QMAX, Int8Linear, quantize_rows
from tandem.engine.models.projections import int4_group


def test_int8_rows_reconstruct_within_half_a_step_of_their_own_scale():
    weight = torch.randn(48, 96) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different ranges
    weight[3] = 0
    codes, scale = quantize_rows(weight)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= QMAX
    assert torch.allclose(scale[[0, 47]], weight[[0, 47]].abs().amax(1) / QMAX)  # from the data: not 1
    error = (codes.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()
    assert (codes[3] == 0).all() and scale[3] > 0


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_linear_matches_the_product_with_its_dequantized_weight(rows, with_bias):
    weight, bias = torch.randn(40, 96), (torch.randn(40) if with_bias else None)
    layer = Int8Linear(weight, bias, dtype=torch.bfloat16, device=torch.device("cpu"))
    x = torch.randn(rows, 96)
    expected = x @ layer.dequantize().t() + (0 if bias is None else bias)
    out = layer(x.to(torch.bfloat16)).float()
    assert out.shape == (rows, 40) and layer.kernel == "int8"
    assert (out - expected).abs().max().item() < 0.02 * expected.abs().max().item()  # bfloat16 activations
    assert layer.nbytes < weight.numel() * 2 / 1.9  # a byte per weight, the scales and bias beside it


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_reconstruct_within_half_a_step(group):
    weight = torch.randn(32, 256)
    q = Int4Weight.quantize(weight, group)
    assert q.group == group and q.scale.shape == (32, 256 // group) and int(q.codes.max()) <= 15
    error = (q.dequantize() - weight).abs()
    assert (error <= q.scale.repeat_interleave(group, dim=1) / 2 + 1e-6).all()
    layer = Int4Linear(q, None, device=torch.device("cpu"))
    x = torch.randn(3, 256)
    expected = x @ q.dequantize().t()
    assert (layer(x.to(torch.bfloat16)).float() - expected).abs().max() < 0.02 * expected.abs().max()


def test_int4_refuses_groups_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="kernel takes 32, 64, 128"):
        Int4Weight.quantize(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="divisible by the group"):
        Int4Weight.quantize(torch.randn(4, 96), 64)
    assert int4_group("int4_g128", 576) == 64 and int4_group("int4_g128", 1536) == 128
    assert int4_group("int4", 1536) == 32
    with pytest.raises(ValueError, match="divisible by 32"):
        int4_group("int4", 100)


@pytest.fixture(scope="module")
def tiny_folder(embedded, tmp_path_factory):
    from tests.engine.tiny_models import write_tiny_model

    folder = tmp_path_factory.mktemp("tiny-qwen2")  # biases on Q/K/V: they must survive quantization
    write_tiny_model(folder, "qwen2", embedded.tokenizer)
    return folder


@pytest.mark.parametrize("weight_format, kind", [("int8", Int8Linear), ("int4", Int4Linear),
                                                  ("int4_g128", Int4Linear)])
def test_a_hugging_face_folder_loads_in_each_format_close_to_its_dense_logits(tiny_folder, weight_format, kind):
    dense = load_model(tiny_folder, dtype=torch.float32, progress=False)
    quantized = load_model(tiny_folder, dtype=torch.bfloat16, weight_format=weight_format, progress=False)
    assert quantized.weight_format == weight_format
    layers = quantized.model.layers
    assert all(isinstance(p, kind) for layer in layers for p in (layer.qkv, layer.o, layer.mlp.gate_up,
                                                                 layer.mlp.down))
    assert isinstance(quantized.model.lm_head, Int8Linear)  # the head stays int8 under int4 too
    ids = torch.tensor(quantized.tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    want, got = (_last_logits(m.model, ids) for m in (dense, quantized))
    # Random Gaussian weights are 4-bit's worst case (no outliers to spend the range on): int4 keeps the direction
    # of the logits roughly, int8 keeps them and their argmax.
    if weight_format == "int8":
        assert torch.cosine_similarity(want, got, dim=0) > 0.999 and got.argmax() == want.argmax()
    else:
        assert torch.cosine_similarity(want, got, dim=0) > 0.9
    weight_bytes = sum(p.nbytes for p in quantized.model.projections())
    assert weight_bytes < sum(p.nbytes for p in dense.model.projections()) / 3  # float32 is 4 bytes a weight


def test_quantized_weights_refuse_a_float32_compute_dtype_and_unknown_formats(tiny_folder):
    with pytest.raises(ValueError, match="int8 weights compute in bfloat16"):
        load_model(tiny_folder, dtype=torch.float32, weight_format="int8", progress=False)
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(tiny_folder, dtype=torch.bfloat16, weight_format="int3", progress=False)


def _last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    from tandem.engine.attention.metadata import AttentionMetadata
    from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

    c = model.config
    cache = PagedKVCache(KVCacheSpec(c.num_layers, 4, 16, model.num_kv_heads, c.head_dim, model.dtype))
    meta = AttentionMetadata.build([len(ids)], [0], [[0, 1, 2, 3]], 16, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model.forward(ids, torch.arange(len(ids)), meta, cache)
        return model.compute_logits(hidden[-1:]).float()[0]


_AVX2_INT8 = """
import json, torch
from tandem.engine.hardware.cpu_features import cpu_features
from tandem.engine.models.int8 import Int8Linear
torch.manual_seed(0)
weight = torch.randn(64, 128)
layer = Int8Linear(weight, None, dtype=torch.bfloat16, device=torch.device("cpu"))
x = torch.randn(4, 128)
expected = x @ layer.dequantize().t()
error = ((layer(x.to(torch.bfloat16)).float() - expected).abs().max() / expected.abs().max()).item()
print(json.dumps({"capability": cpu_features().capability, "kernel": layer.kernel, "error": error}))
"""


def test_the_int8_kernel_runs_on_an_avx2_capped_cpu():
    """ATEN_CPU_CAPABILITY=avx2 (with oneDNN capped likewise) dispatches torch's int8 kernel as an AVX2-only CPU
    would; it must run there and agree with dense math, as it does on AVX-512."""
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", _AVX2_INT8], env=env, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["kernel"] == "int8" and found["error"] < 0.02
    assert found["capability"] in ("AVX2", "DEFAULT")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="int8 weights on CUDA need a CUDA GPU")
def test_int8_weights_on_cuda_match_dense_math_and_serve_the_embedded_model():
    device = torch.device("cuda")
    weight = torch.randn(256, 576)
    layer = Int8Linear(weight, None, dtype=torch.bfloat16, device=device)
    x = torch.randn(8, 576, device=device)
    expected = x @ layer.dequantize().t()
    out = layer(x.to(torch.bfloat16)).float()
    assert (out - expected).abs().max().item() < 0.02 * expected.abs().max().item()
    print(f"int8 kernel on CUDA: {layer.kernel}")  # int8: torch's int8 kernel; int8 widened: the fallback
    from tandem.engine.core.generator import Generator
    from tandem.engine.sampling_params import SamplingParams

    loaded = load_model(progress=False, dtype=torch.bfloat16, device=device, weight_format="int8")
    with Generator(loaded, max_model_len=256, kv_cache_dtype="int8") as generator:
        result = generator.generate(loaded.tokenizer.encode("The capital of France is"),
                                    SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in result.text
