"""The CPU probe: what it reports, the setting that turns features off, and an AVX2 CPU reproduced on any x86."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tandem.engine.hardware import cpu_features as probe_module
from tandem.engine.hardware.cpu_features import DISABLE_ENV, FEATURES, CpuFeatures, cpu_features, probe


def test_probe_reports_torchs_capability_and_this_cpus_flags():
    found = probe()
    assert found.capability == torch.backends.cpu.get_cpu_capability()
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    assert set(found.flags) <= flags
    assert ("avx2" in found.flags) == ("avx2" in flags)
    # Every feature that is off says why, and one that is on has no reason.
    for name in FEATURES:
        assert (name in found.why_not) != getattr(found, name), name


def test_probe_finds_the_kernels_torch_runs_everywhere():
    """oneDNN's float32 linear and the int4 kernel run on every x86-64 CPU torch 2.13 supports (AVX2 included)."""
    found = probe()
    assert found.onednn and found.int4, found.describe()


def test_a_kernel_that_runs_but_answers_wrong_counts_as_missing():
    assert probe_module._try(lambda: False) == "ran but gave a wrong answer"
    assert probe_module._try(lambda: 1 / 0).startswith("ZeroDivisionError")
    assert probe_module._try(lambda: True) is None


def test_without_turns_features_off_and_says_why():
    found = CpuFeatures(capability="AVX512", flags=("avx2", "avx512f"), onednn=True, onednn_bf16=True, int4=False,
                        why_not={"int4": "RuntimeError: no kernel"})
    off = found.without(["onednn_bf16", "int4"], "TANDEM_CPU_DISABLE=onednn_bf16,int4")
    assert (off.onednn, off.onednn_bf16, off.int4) == (True, False, False)
    assert off.why_not == {"onednn_bf16": "TANDEM_CPU_DISABLE=onednn_bf16,int4", "int4": "RuntimeError: no kernel"}
    text = off.describe()
    assert "CPU AVX512 (avx2 avx512f)" in text and "oneDNN float32 linear: yes" in text
    assert "oneDNN bfloat16 inner product: no (TANDEM_CPU_DISABLE=onednn_bf16,int4)" in text
    with pytest.raises(ValueError, match="unknown CPU feature 'amx'; known: onednn, onednn_bf16, int4"):
        found.without(["amx"], "test")


@pytest.fixture
def fresh_probe():
    """cpu_features() is cached per process: clear it around a test that changes the setting."""
    cpu_features.cache_clear()
    yield
    cpu_features.cache_clear()


def test_the_setting_turns_probed_features_off(monkeypatch, fresh_probe):
    monkeypatch.setenv(DISABLE_ENV, " onednn_bf16, int4 ")
    found = cpu_features()
    assert not found.onednn_bf16 and not found.int4 and found.onednn == probe().onednn
    assert cpu_features() is found  # once per process
    assert "int4" in found.why_not and f"{DISABLE_ENV}=" in found.why_not["int4"]


def test_a_misspelled_setting_is_an_error_naming_the_features(monkeypatch, fresh_probe):
    monkeypatch.setenv(DISABLE_ENV, "onednn_bf61")
    with pytest.raises(ValueError, match="unknown CPU feature 'onednn_bf61'; known: onednn, onednn_bf16, int4"):
        cpu_features()


_PROBE_JSON = ("import json; from tandem.engine.hardware.cpu_features import probe; f = probe(); "
               "print(json.dumps({'capability': f.capability, 'onednn_bf16': f.onednn_bf16, 'int4': f.int4, "
               "'onednn': f.onednn}))")


def test_avx2_settings_reproduce_an_avx2_cpu():
    """ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 make an AVX-512 CPU dispatch like an AVX2 one (on an
    AVX2 CPU they change nothing): oneDNN then has no bfloat16 inner product, and the probe says so."""
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", _PROBE_JSON], env=env, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    has_avx2 = "avx2" in probe().flags
    assert found["capability"] == ("AVX2" if has_avx2 else "DEFAULT")
    assert found["onednn_bf16"] is False and found["onednn"] and found["int4"]
