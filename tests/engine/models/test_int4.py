"""Packed 4-bit GGUF weights: exact unpacking, the int4 kernel against dense math, and the packed model."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize

from tandem.engine.hardware.cpu_features import CpuFeatures, cpu_features
from tandem.engine.loader import default_model_path, load_checkpoint, load_model
from tandem.engine.loader.gguf_file import _unpack_q4
from tandem.engine.models.int4 import Int4Linear, Int4Weight
from tandem.engine.models.linear import candidates
from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_unpacked_codes_dequantize_exactly_like_gguf(qtype):
    from gguf import dequantize

    data = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    blocks = quantize(data, qtype)
    weight = _unpack_q4(blocks, qtype, rows=40)
    assert weight.codes.dtype == torch.uint8 and int(weight.codes.max()) <= 15
    np.testing.assert_array_equal(weight.dequantize().numpy(), dequantize(blocks, qtype))


@pytest.mark.parametrize("rows", [48, 40])  # 40 is not a multiple of the kernel's 16: padded
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_matches_dense_product(rows, with_bias):
    data = np.random.default_rng(1).standard_normal((rows, 128)).astype(np.float32)
    weight = _unpack_q4(quantize(data, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1, rows=rows)
    bias = torch.randn(rows) if with_bias else None
    layer = Int4Linear(weight, bias, device=torch.device("cpu"))
    x = torch.randn(5, 128)
    expected = x @ weight.dequantize().t() + (0 if bias is None else bias)
    out = layer(x.to(torch.bfloat16)).float()
    assert out.shape == (5, rows)
    # bfloat16 activations and scales: relative error of a few 1e-3 of the output scale.
    assert (out - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_packed_checkpoint_holds_the_same_weights():
    """Every packed projection (Q/K rows un-permuted too) equals the dense loader's float32 tensor exactly."""
    path = default_model_path()
    dense = load_checkpoint(path, progress=False).weights
    packed = load_checkpoint(path, progress=False, packed=True).weights
    int4 = {k: v for k, v in packed.items() if isinstance(v, Int4Weight)}
    assert len(int4) == 30 * 7  # every projection of the embedded model is Q4_1
    for name, weight in int4.items():
        torch.testing.assert_close(weight.dequantize(), dense[name].materialize(), rtol=0, atol=0, msg=name)


# Each bfloat16 path a CPU may take: packed weights on tandem's integer-dot kernels (AVX-512 VNNI or AVX2), on
# torch's int4 kernel, or expanded (neither), dense ones on oneDNN (AVX-512) or widened to float32 (AVX2). The
# features are forced, so every machine runs every path its CPU can run at all.
PATHS = {
    "bf16-packed-int-dot-avx512": (True, {"cpu_kernels": True, "cpu_kernels_avx512": True}),
    "bf16-packed-int-dot-avx2": (True, {"cpu_kernels": True, "cpu_kernels_avx512": False}),
    "bf16-packed-int4": (True, {"int4": True, "cpu_kernels": False}),
    "bf16-packed-expanded": (True, {"int4": False, "cpu_kernels": False}),
    "bf16-dense-onednn": (False, {"onednn_bf16": True}),
    "bf16-dense-widen": (False, {"onednn_bf16": False}),
}


def forced(**on: bool) -> CpuFeatures:
    """This CPU's features with `on` forced; skips the test when it forces on a kernel this CPU cannot run."""
    here = cpu_features()
    for name, value in on.items():
        if value and not getattr(here, name):
            pytest.skip(f"{name} does not run on this CPU ({here.capability}): {here.why_not[name]}")
    return dataclasses.replace(here, **on)


@pytest.mark.reference
@pytest.mark.parametrize("path", list(PATHS))
def test_bfloat16_models_stay_close_to_float32(embedded_generator, path):
    """Reduced precision cannot match float32 to 1e-3; it must keep the same next-token distribution: the same
    top token and a KL divergence from float32 under 0.02 nats (measured: at most 0.009) on every prompt."""
    from tandem.engine.core.generator import Generator

    packed, on = PATHS[path]
    features = forced(**on)
    loaded = load_model(progress=False, weight_format="packed" if packed else "dense", dtype=torch.bfloat16,
                        cpu=features)
    generator = Generator(loaded, max_model_len=2048)
    kernels = loaded.model.kernel_counts()
    if path.startswith("bf16-packed-int-dot"):
        assert kernels == {"int_dot": 30 * 4 + 1}  # QKV, O, gate/up and down of every layer, and the Q8_0 head
        assert {p.path for p in loaded.model.projections()} == {3 if on["cpu_kernels_avx512"] else 2}
        assert loaded.model.weight_bytes_per_token() < embedded_generator.loaded.model.weight_bytes_per_token() / 5
    elif path == "bf16-packed-int4":
        assert kernels["int4"] == 30 * 4  # QKV, O, gate/up and down of every layer; the tied head is dense
        assert loaded.model.weight_bytes_per_token() < embedded_generator.loaded.model.weight_bytes_per_token() / 4
    else:
        # dense weights, and packed ones expanded, run on kernels this CPU (forced or found here) runs: oneDNN
        # where it has bfloat16, else F.linear or widening
        allowed = set(candidates(torch.bfloat16, features))
        assert "onednn" in allowed if features.onednn_bf16 else "onednn" not in allowed
        for projection in loaded.model.projections():
            assert set(projection.plan.by_rows.names()) <= allowed
    for name, spec in PROMPTS.items():
        ids = _prompt_ids(loaded.tokenizer, spec)
        reference = embedded_generator.prompt_logits(ids).log_softmax(-1)
        logprobs = generator.prompt_logits(ids).log_softmax(-1)
        assert int(logprobs.argmax()) == int(reference.argmax()), name
        kl = (reference.exp() * (reference - logprobs)).sum().item()
        assert kl < 0.02, (name, kl)
    generator.block_pool.check_integrity()


def test_packed_weights_are_expanded_where_no_4_bit_kernel_runs(embedded, caplog):
    """Without the int4 kernel and tandem's own a packed load still runs: every projection expanded to
    bfloat16, the very products of a dense bfloat16 load, and a warning that says why it takes 4x the memory."""
    from tandem.engine.core.generator import Generator

    no_int4 = forced(int4=False, cpu_kernels=False)
    with caplog.at_level(logging.WARNING, logger="tandem.engine.models.llama"):
        packed = load_model(progress=False, weight_format="packed", dtype=torch.bfloat16, cpu=no_int4)
    assert "int4 CPU kernel does not run here" in caplog.text and "nor do tandem's C++ kernels" in caplog.text
    assert "4x the weight memory" in caplog.text
    assert "int4" not in packed.model.kernel_counts()
    dense = load_model(progress=False, dtype=torch.bfloat16, cpu=no_int4)
    ids = embedded.tokenizer.encode("Packed weights that cannot stay packed are expanded.")
    a = Generator(packed, max_model_len=128).prompt_logits(ids)
    b = Generator(dense, max_model_len=128).prompt_logits(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_packed_needs_bfloat16_and_a_gguf(tmp_path):
    with pytest.raises(ValueError, match="compute in bfloat16"):
        load_model(progress=False, weight_format="packed", dtype=torch.float32)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="Hugging Face folder has none"):
        load_checkpoint(tmp_path, packed=True)
