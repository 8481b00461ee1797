"""Which attention backend runs, and why: the pure decision (choose_backend), select_backend building it and
logging it once, and the matmul precision the Triton kernels use for each dtype (dot_precision). Triton's import
is made to fail for real (None in sys.modules), not faked."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from tandem.engine.attention import TorchAttentionBackend
from tandem.engine.attention import triton_backend
from tandem.engine.attention.triton_backend import BackendChoice, choose_backend, select_backend

LOGGER = triton_backend.__name__
NO_TRITON = "ImportError: No module named 'triton'"


def test_auto_on_the_cpu_is_the_reference_and_does_not_need_triton():
    choice = choose_backend("auto", "cpu", NO_TRITON)
    assert choice == BackendChoice("torch", "cpu device")
    assert choice.describe() == "attention backend: torch (cpu device)"


def test_auto_on_cuda_is_triton_when_it_imports():
    choice = choose_backend("auto", "cuda", None)
    assert choice == BackendChoice("triton", "cuda")
    assert choice.describe() == "attention backend: triton (cuda)"


@pytest.mark.parametrize("name", ["auto", "triton"])
def test_a_broken_triton_on_cuda_is_an_error_never_the_slow_reference(name):
    with pytest.raises(ValueError) as raised:
        choose_backend(name, "cuda", NO_TRITON)
    message = str(raised.value)
    assert NO_TRITON in message
    assert "pip install triton" in message and "attention_backend: torch" in message


def test_triton_asked_for_off_cuda_runs_in_the_interpreter_but_still_needs_triton():
    assert choose_backend("triton", "cpu", None) == BackendChoice("triton", "cpu device, Triton interpreter")
    with pytest.raises(ValueError, match="pip install triton"):
        choose_backend("triton", "cpu", NO_TRITON)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_torch_asked_for_is_the_reference_anywhere(device_type):
    choice = choose_backend("torch", device_type, NO_TRITON)
    assert choice == BackendChoice("torch", "attention_backend: torch")
    assert choice.describe() == "attention backend: torch (attention_backend: torch)"


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention backend must be one of auto, torch, triton, got 'flash'"):
        choose_backend("flash", "cuda", None)


@pytest.fixture
def triton_missing(monkeypatch):
    """Importing triton (and so the kernel modules) raises ImportError until the test ends."""
    import tandem.engine.attention as package

    monkeypatch.setitem(sys.modules, "triton", None)
    for module in ("triton_decode", "triton_prefill", "triton_norm"):
        monkeypatch.delitem(sys.modules, f"{package.__name__}.{module}", raising=False)
        monkeypatch.delattr(package, module, raising=False)


def test_select_backend_reports_a_failing_triton_import_on_cuda(triton_missing):
    with pytest.raises(ValueError, match=r"failed to import: ModuleNotFoundError: import of triton halted.*"
                                         r"pip install triton"):
        select_backend("auto", torch.device("cuda"))


def test_select_backend_on_the_cpu_works_without_triton(triton_missing, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend = select_backend("auto", torch.device("cpu"))
    assert type(backend) is TorchAttentionBackend
    assert backend.choice == BackendChoice("torch", "cpu device")
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == ["attention backend: torch (cpu device)"]


@pytest.mark.parametrize("name, device, line", [
    ("auto", "cuda", "attention backend: triton (cuda)"),  # builds the backend; nothing runs on the device
    ("auto", "cpu", "attention backend: torch (cpu device)"),
    ("torch", "cuda", "attention backend: torch (attention_backend: torch)"),
])
def test_select_backend_logs_one_line(caplog, name, device, line):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend = select_backend(name, torch.device(device))
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [(logging.INFO, line)]
    assert backend.choice.describe() == line


def test_select_backend_logs_nothing_when_told_not_to(caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        backend = select_backend("auto", torch.device("cuda"), log=False)
    assert backend.choice.name == "triton"
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_choosing_the_reference_does_not_import_triton():
    code = ("import sys, torch\n"
            "from tandem.engine.attention.triton_backend import select_backend\n"
            "select_backend('auto', torch.device('cpu'))\n"
            "select_backend('torch', torch.device('cuda'))\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_float32_kernels_multiply_at_ieee_precision():
    from tandem.engine.attention.triton_decode import dot_precision

    assert dot_precision(torch.float32) == "ieee"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_kernels_multiply_on_the_tensor_cores(dtype):
    from tandem.engine.attention.triton_decode import TENSOR_CORE_PRECISION, dot_precision

    assert dot_precision(dtype) == TENSOR_CORE_PRECISION == "tf32"


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_dtypes_the_kernels_do_not_take_are_refused(dtype):
    from tandem.engine.attention.triton_decode import dot_precision

    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        dot_precision(dtype)
