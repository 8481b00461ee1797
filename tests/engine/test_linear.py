"""Every projection kernel against float64 math, whichever the CPU would pick: the choice is forced through
CpuFeatures, so an AVX-512 machine checks the AVX2 paths too. A kernel the CPU cannot run is skipped with why."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.cpu_features import CpuFeatures, cpu_features
from tandem.engine.models import linear as linear_module
from tandem.engine.models.linear import KERNELS, WIDEN_FROM_ROWS, Linear, choose_kernel

CPU = torch.device("cpu")


def _features(**on: bool) -> CpuFeatures:
    return CpuFeatures(capability="test", flags=(), **({"onednn": True, "onednn_bf16": True, "int4": True} | on))


# kernel -> (weight dtype, the features that make choose_kernel pick it)
CASES = {
    "split": (torch.float32, _features()),
    "linear": (torch.float32, _features(onednn=False)),
    "onednn": (torch.bfloat16, _features()),
    "widen": (torch.bfloat16, _features(onednn_bf16=False)),
}


def test_every_kernel_has_a_case():
    assert set(CASES) == set(KERNELS)


def test_kernel_choice_follows_the_features():
    for kernel, (dtype, features) in CASES.items():
        assert choose_kernel(dtype, CPU, features) == kernel
    # Off the CPU, and for dtypes without a CPU kernel of their own, F.linear.
    assert choose_kernel(torch.bfloat16, torch.device("cuda"), _features()) == "linear"
    assert choose_kernel(torch.float16, CPU, _features()) == "linear"


def _runs_here(kernel: str) -> None:
    here = cpu_features()
    if kernel == "onednn" and not here.onednn_bf16:
        pytest.skip(f"oneDNN's bfloat16 inner product does not run on this CPU ({here.capability}): "
                    f"{here.why_not['onednn_bf16']}")
    if kernel == "split" and not here.onednn:
        pytest.skip(f"no oneDNN float32 linear here: {here.why_not['onednn']}")


@pytest.mark.parametrize("kernel", list(CASES))
@pytest.mark.parametrize("rows", [1, 3, WIDEN_FROM_ROWS - 1, WIDEN_FROM_ROWS, 70])  # one row, both sides of
# WIDEN_FROM_ROWS, a batch
@pytest.mark.parametrize("out_features,with_bias", [(45, True), (64, False)])  # odd: the split layout pads
def test_kernel_matches_float64_math(kernel, rows, out_features, with_bias, monkeypatch):
    _runs_here(kernel)
    dtype, features = CASES[kernel]
    # Chunks of 8 rows of 96 inputs: a widened product runs over 6 chunks, the last one short.
    monkeypatch.setattr(linear_module, "WIDEN_CHUNK_ELEMENTS", 8 * 96)
    g = torch.Generator().manual_seed(rows * 100 + out_features)
    weight = torch.randn(out_features, 96, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    layer = Linear(weight, bias, dtype=dtype, device=CPU, cpu=features)
    assert layer.kernel == kernel
    out = layer(x)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    # float32: summation order only; bfloat16: the output (and the bias sum) rounded to 8 significant bits.
    tolerance = 1e-4 if dtype == torch.float32 else 2 ** -7
    assert ((out.double() - expected).abs() <= tolerance * (1 + expected.abs())).all()


def test_widened_rows_equal_the_one_row_product():
    """A row's result does not depend on how many rows share the call (both accumulate in float32 and round the
    output once), up to summation order: within one bfloat16 step of each other."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 576, generator=g).to(torch.bfloat16)
    x = torch.randn(WIDEN_FROM_ROWS + 4, 576, generator=g).to(torch.bfloat16)
    layer = Linear(weight, None, dtype=torch.bfloat16, device=CPU, cpu=_features(onednn_bf16=False))
    together = layer(x).float()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])]).float()
    assert ((together - alone).abs() <= 2 ** -7 * alone.abs() + 1e-6).all()
    assert (together == alone).float().mean() > 0.9


@pytest.mark.parametrize("first_in_inference_mode", [True, False])
def test_widened_products_run_in_and_out_of_inference_mode(first_in_inference_mode):
    """The widening buffer is reused across calls, whichever grad mode the first call ran in."""
    linear_module._widen_buffer.__dict__.clear()
    layer = Linear(torch.randn(40, 64).to(torch.bfloat16), None, dtype=torch.bfloat16, device=CPU,
                   cpu=_features(onednn_bf16=False))
    x = torch.randn(WIDEN_FROM_ROWS, 64).to(torch.bfloat16)
    results = []
    for inference in (first_in_inference_mode, not first_in_inference_mode):
        with torch.inference_mode(inference):
            results.append(layer(x))
    assert torch.equal(results[0], results[1])
