"""Kernel choice by measurement: answers cached per machine on disk, the settings, and the decode attention
kernels (each checked against the other on any machine, whichever the tuner picks here)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tandem.engine.attention.torch_ref import DECODE_KERNELS, decode_kernel, tuned_decode_plan
from tandem.engine.hardware.cpu_features import CpuFeatures, cpu_features
from tandem.engine.hardware.kernel_tuning import TUNING_ENV, KernelTuner, time_per_call


def _measure(calls: list, answer: str = "a"):
    def measure() -> dict:
        calls.append(1)
        return {"pick": answer}
    return measure


def test_an_answer_is_measured_once_per_machine_and_kept_on_disk(tmp_path):
    calls: list = []
    first = KernelTuner(cpu_features(), threads=1, cache_dir=tmp_path)
    assert first.choose("entry", _measure(calls)) == {"pick": "a"}
    assert first.choose("entry", _measure(calls, "b")) == {"pick": "a"} and len(calls) == 1
    # A new process on the same machine reads it; another thread count is another machine key.
    assert KernelTuner(cpu_features(), threads=1, cache_dir=tmp_path).choose("entry", _measure(calls, "b")) \
        == {"pick": "a"} and len(calls) == 1
    other = KernelTuner(cpu_features(), threads=2, cache_dir=tmp_path)
    assert other.path != first.path
    assert other.choose("entry", _measure(calls, "b")) == {"pick": "b"} and len(calls) == 2
    data = json.loads(first.path.read_text())
    assert data["machine"]["threads"] == 1 and data["machine"]["torch"] == torch.__version__


def test_what_the_probe_found_is_part_of_the_key(tmp_path):
    """A process whose probe (or TANDEM_CPU_DISABLE) turned a kernel off never reads answers that use it."""
    here = cpu_features()
    other = CpuFeatures(here.capability, here.flags, onednn=here.onednn, onednn_bf16=not here.onednn_bf16,
                        int4=here.int4)  # on an AVX-512 CPU: what TANDEM_CPU_DISABLE=onednn_bf16 gives; on AVX2 more
    assert KernelTuner(here, threads=1, cache_dir=tmp_path).path != KernelTuner(other, threads=1,
                                                                                cache_dir=tmp_path).path


def test_a_corrupt_cache_is_measured_again(tmp_path):
    tuner = KernelTuner(cpu_features(), threads=1, cache_dir=tmp_path)
    tuner.path.parent.mkdir(parents=True, exist_ok=True)
    tuner.path.write_text("{not json")
    calls: list = []
    assert KernelTuner(cpu_features(), threads=1, cache_dir=tmp_path).choose("e", _measure(calls)) == \
        {"pick": "a"} and calls == [1]
    assert json.loads(tuner.path.read_text())["entries"] == {"e": {"pick": "a"}}


def test_an_unwritable_cache_is_a_warning_not_a_failure(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="tandem.engine.hardware.kernel_tuning"):
        measured = KernelTuner(cpu_features(), threads=1, cache_dir=blocker / "kernels").choose("e", _measure([]))
    assert measured == {"pick": "a"}
    assert "not cached" in caplog.text


def test_the_setting_turns_measurement_off_and_rejects_other_values(monkeypatch):
    monkeypatch.setenv(TUNING_ENV, "off")
    assert not KernelTuner.from_environment(cpu_features()).enabled
    monkeypatch.setenv(TUNING_ENV, "On")
    assert KernelTuner.from_environment(cpu_features()).enabled
    monkeypatch.setenv(TUNING_ENV, "fast")
    with pytest.raises(ValueError, match="TANDEM_KERNEL_TUNING must be on or off"):
        KernelTuner.from_environment(cpu_features())


def test_time_per_call_measures_the_calls():
    x = torch.rand(256, 256)
    slow = time_per_call([lambda: x @ x @ x @ x])
    fast = time_per_call([lambda: x.sum()])
    assert 0 < fast < slow


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5])
def test_every_decode_kernel_gives_the_same_attention(dtype, batch):
    g = torch.Generator().manual_seed(batch)
    hk, group, d, s = 3, 3, 64, 40
    grouped = torch.randn(batch, hk, group, d, generator=g).to(dtype)
    keys, values = (torch.randn(batch, hk, s, d, generator=g).to(dtype) for _ in range(2))
    hidden = torch.arange(s)[None, :] >= torch.tensor([s - 3 * i for i in range(batch)])[:, None]  # padding
    reference = decode_kernel("grouped", grouped.double(), keys.double(), values.double(), hidden, d ** -0.5)
    for kernel in DECODE_KERNELS:
        out = decode_kernel(kernel, grouped, keys, values, hidden, d ** -0.5)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), reference, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="unknown decode attention kernel"):
        decode_kernel("flash", grouped, keys, values, hidden, 1.0)


def test_the_model_runs_what_the_tuner_measured():
    """Built with a tuner, every projection runs its shape's measured plan, decode attention its measured plan,
    also after the engine swaps the attention backend; --verbose lists them."""
    from tandem.engine.attention import TorchAttentionBackend
    from tandem.engine.loader import load_model
    from tandem.engine.models.linear import tuned_plan

    tuner = KernelTuner(cpu_features())  # this machine's cache: measured once, by whichever test loads first
    loaded = load_model(progress=False, tuner=tuner)
    for projection in loaded.model.projections():
        plan = tuned_plan(tuner, torch.float32, projection.out_features, projection.in_features)
        assert projection.plan == plan
    config = loaded.config
    plan = tuned_decode_plan(tuner, torch.float32, config.num_kv_heads, config.num_heads // config.num_kv_heads,
                             config.head_dim)
    assert loaded.model.decode_plan == plan and loaded.model.attention.decode_plan == plan
    loaded.model.attention = TorchAttentionBackend()
    assert loaded.model.attention.decode_plan == plan
    lines = loaded.describe_kernels()
    assert f"kernels: measured on this CPU with {tuner.threads} thread(s), cached in {tuner.path}" in lines
    assert any(line.startswith("  49152x576 (1 x): ") for line in lines)
    assert f"decode attention: {plan.describe('sequence')}" in lines
