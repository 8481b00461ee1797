"""Every projection kernel against float64 math on every machine (each is forced through its plan, so an AVX-512
machine checks what an AVX2 one would pick too; a kernel the CPU cannot run is skipped with why), the fixed plans
the probe picks without measurement, and how a measured plan is chosen."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.hardware.cpu_features import CpuFeatures, cpu_features
from tandem.engine.hardware.kernel_tuning import BucketPlan, KernelTuner
from tandem.engine.models import linear as linear_module
from tandem.engine.models.linear import (KERNELS, ROW_BUCKETS, WIDEN_FROM_ROWS, Linear, LinearPlan, candidates,
                                         fixed_plan, tuned_plan)

CPU = torch.device("cpu")


def _features(**on: bool) -> CpuFeatures:
    return CpuFeatures(capability="test", flags=(), **({"onednn": True, "onednn_bf16": True, "int4": True} | on))


# (kernel, dtype): every kernel with every dtype it runs
CASES = [(name, dtype) for name, spec in KERNELS.items() for dtype in spec.needs]


def _runs_here(kernel: str, dtype: torch.dtype) -> None:
    needs = KERNELS[kernel].needs[dtype]
    here = cpu_features()
    if needs is not None and not getattr(here, needs):
        pytest.skip(f"{kernel} needs {needs}, which does not run on this CPU ({here.capability}): "
                    f"{here.why_not[needs]}")


@pytest.mark.parametrize("kernel,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
@pytest.mark.parametrize("rows", [0, 1, 3, WIDEN_FROM_ROWS, 70])  # 0: an expert rank given no tokens
@pytest.mark.parametrize("out_features,with_bias", [(45, True), (64, False)])  # odd: the columns layout pads
def test_kernel_matches_float64_math(kernel, dtype, rows, out_features, with_bias, monkeypatch):
    _runs_here(kernel, dtype)
    # Chunks of 8 rows of 96 inputs: a widened product runs over 6 chunks, the last one short.
    monkeypatch.setattr(linear_module, "WIDEN_CHUNK_ELEMENTS", 8 * 96)
    g = torch.Generator().manual_seed(rows * 100 + out_features)
    weight = torch.randn(out_features, 96, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    layer = Linear(weight, bias, dtype=dtype, device=CPU, plan=LinearPlan.of(KERNELS[kernel].layout, (1, kernel)))
    out = layer(x)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    # float32: summation order only; bfloat16: the output (and the bias sum) rounded to 8 significant bits.
    tolerance = 1e-4 if dtype == torch.float32 else 2 ** -7
    assert ((out.double() - expected).abs() <= tolerance * (1 + expected.abs())).all()


def test_candidates_follow_the_features():
    f32, bf16 = torch.float32, torch.bfloat16
    assert set(candidates(f32, _features())) == {"split", "onednn_t", "linear", "onednn", "onednn_packed"}
    assert set(candidates(f32, _features(onednn=False))) == {"split", "linear"}
    assert set(candidates(bf16, _features())) == {"linear", "onednn", "widen", "onednn_packed"}
    assert set(candidates(bf16, _features(onednn_bf16=False))) == {"linear", "widen"}  # an AVX2 CPU


def test_fixed_plans_follow_the_features():
    f32, bf16 = torch.float32, torch.bfloat16
    assert fixed_plan(f32, CPU, _features()) == LinearPlan.of("columns", (1, "split"), (2, "onednn_t"))
    assert fixed_plan(f32, CPU, _features(onednn=False)) == LinearPlan.of("rows", (1, "linear"))
    assert fixed_plan(bf16, CPU, _features()) == LinearPlan.of("rows", (1, "onednn"))
    assert fixed_plan(bf16, CPU, _features(onednn_bf16=False)) == \
        LinearPlan.of("rows", (1, "linear"), (WIDEN_FROM_ROWS, "widen"))
    # Off the CPU, and for dtypes without a CPU kernel of their own, F.linear.
    assert fixed_plan(bf16, torch.device("cuda"), _features()) == LinearPlan.of("rows", (1, "linear"))
    assert fixed_plan(torch.float16, CPU, _features()) == LinearPlan.of("rows", (1, "linear"))


def test_a_plan_runs_each_kernel_on_its_rows():
    plan = BucketPlan.from_buckets(["split", "onednn_t", "onednn_t", "split", "split"], ROW_BUCKETS)
    assert plan.kernels == ((1, "split"), (2, "onednn_t"), (32, "split"))  # 2 = between buckets 1 and 4 (log)
    assert [plan.kernel_for(r) for r in (1, 2, 7, 31, 32, 5000)] == ["split", "onednn_t", "onednn_t", "onednn_t",
                                                                      "split", "split"]
    assert plan.describe("row") == "split (1 row), onednn_t (2-31 rows), split (32+ rows)"
    with pytest.raises(ValueError, match="columns layout"):
        LinearPlan.of("rows", (1, "split"))
    with pytest.raises(ValueError, match="ascend from 1"):
        BucketPlan(((2, "split"),))


def test_a_layer_switches_kernels_by_rows_and_keeps_its_results():
    """One stored weight, two kernels: a row's result does not depend on which ran it (float32 summation order
    only: the results are about 24 in size, sums of 576 products, and two orders differed by 2e-5 on an Intel
    Xeon with AVX-512 FP16; a wrong row would be off by about its size)."""
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(300, 576, generator=g), torch.randn(20, 576, generator=g)
    layer = Linear(weight, None, dtype=torch.float32, device=CPU,
                   plan=LinearPlan.of("columns", (1, "split"), (8, "onednn_t" if cpu_features().onednn else "split")))
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-4)


def test_the_measured_plan_takes_the_layout_that_loses_least_and_the_fastest_kernel_per_bucket(tmp_path,
                                                                                                monkeypatch):
    """With timings made up per kernel and bucket: the layout whose best kernels lose least (summed over the
    buckets, relative to the fastest of any layout) is chosen, then the fastest kernel of that layout in each
    bucket; the answer is cached for the next tuner of the same machine."""
    ms = {"split": [1.0, 9.0, 9.0, 9.0, 9.0], "onednn_t": [2.0, 3.0, 3.0, 3.0, 3.0],
          "onednn_packed": [1.5, 2.0, 2.0, 4.0, 4.0], "onednn": [9.0] * 5, "linear": [9.0] * 5}
    timed = []

    def fake_time(calls):
        kernel, bucket = timed_now[0]
        timed.append((kernel, bucket))
        return ms[kernel][ROW_BUCKETS.index(bucket)] / 1e3

    real_run = linear_module.run
    timed_now = [None]

    def tracking_run(kernel, x, weight, in_features):
        timed_now[0] = (kernel, x.shape[0])
        return real_run(kernel, x, weight, in_features)

    monkeypatch.setattr(linear_module, "run", tracking_run)
    monkeypatch.setattr(linear_module, "time_per_call", lambda calls: (calls[0](), fake_time(calls))[1])
    tuner = KernelTuner(_features(), threads=1, cache_dir=tmp_path)
    plan = tuned_plan(tuner, torch.float32, 64, 96)
    # Losses against the best per bucket (1.0, 2.0, 2.0, 3.0, 3.0): columns 1 + 1.5 + 1.5 + 1 + 1 = 6; blocked
    # 1.5 + 1 + 1 + 1.33 + 1.33 = 6.17; rows 9 + 4.5 + 4.5 + 3 + 3. Columns wins, split at 1 row, then onednn_t.
    assert plan == LinearPlan.of("columns", (1, "split"), (2, "onednn_t"))
    assert {k for k, _ in timed} == set(candidates(torch.float32, _features()))
    timed.clear()
    again = tuned_plan(KernelTuner(_features(), threads=1, cache_dir=tmp_path), torch.float32, 64, 96)
    assert again == plan and not timed  # read from the cache file, nothing timed


@pytest.mark.parametrize("layout", ["rows", "columns", "blocked"])
def test_every_layout_gives_back_the_dense_weight(layout):
    if layout == "blocked" and not cpu_features().onednn:
        pytest.skip(f"no oneDNN here: {cpu_features().why_not['onednn']}")
    weight = torch.randn(45, 96)  # odd: the columns layout pads it
    kernel = {"rows": "linear", "columns": "split", "blocked": "onednn_packed"}[layout]
    layer = Linear(weight, None, dtype=torch.float32, device=CPU, plan=LinearPlan.of(layout, (1, kernel)))
    assert torch.equal(layer.dense_weight(), weight)
