"""Every Triton kernel compiles for a Hopper GPU (sm_90) on this machine, GPU or not: tests/engine/
triton_cross_compile.py, run in its own process because the compiler needs TRITON_INTERPRET unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.attention.triton_prefill import _CONFIGS

SCRIPT = Path(__file__).with_name("triton_cross_compile.py")
KERNELS = {"_split_kernel", "_combine_kernel", "_prefill_kernel", "_rms_norm_kernel", "_rotary_kernel"}


@pytest.mark.parametrize("every_config", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["first-config", "every-config"])
def test_every_kernel_compiles_for_sm90_in_every_dtype_an_engine_uses(every_config):
    """Each launch in its first autotune configuration; the slow variant compiles every configuration of every
    launch (what triton.autotune times on the GPU at an engine's start)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--arch", "90", *(["--all-configs"] if every_config else [])],
                         env=env, capture_output=True, text=True, timeout=900)
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["failed"] == [], run.stderr[-4000:]
    assert run.returncode == 0, run.stderr[-4000:]
    compiled = report["compiled"]
    assert {row["kernel"] for row in compiled} == KERNELS
    cases = {row["case"] for row in compiled if row["kernel"] in ("_split_kernel", "_prefill_kernel")}
    for mode in ("decode", "prefill"):
        for dtypes in ("bfloat16/bfloat16", "float16/float16", "float32/float32", "bfloat16/int8",
                       "bfloat16/float8_e4m3fn"):
            assert {f"{mode} {dtypes}", f"{mode} {dtypes} window"} <= cases, (mode, dtypes, sorted(cases))
    configs = {json.dumps(row["config"], sort_keys=True) for row in compiled
               if row["case"] == "prefill bfloat16/bfloat16" and row["kernel"] == "_prefill_kernel"}
    assert len(configs) == (len(_CONFIGS) if every_config else 1)
