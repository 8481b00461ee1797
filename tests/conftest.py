"""Shared fixtures: the embedded model (ours and the transformers reference), loaded once per session; the
suite's time report."""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest
import torch

# Two cores on CI: one process, two threads.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Engines run eager unless a test asks for the compiled decode step (tests/engine/models/test_compiled.py): compiling
# the step of each model a test builds would take minutes of the suite.
os.environ.setdefault("TANDEM_COMPILE", "off")
# CPU kernels are the probe's fixed choices (engine/models/linear.py fixed_plan) unless a test asks for measured
# ones (tests/engine/hardware/test_kernel_tuning.py, test_linear.py, the CLI's --verbose test): a choice timed on the
# machine at hand differs from run to run, and so do the near-ties of greedy tests on it (the quantization gate
# failed one run in two on an AVX2 machine); and measuring every shape of every test model cost ~2.5 minutes of
# a fresh machine's suite. Ray replicas and subprocesses inherit the setting.
os.environ.setdefault("TANDEM_KERNEL_TUNING", "off")
# Without a GPU, Triton kernels run on Triton's CPU interpreter (read when a kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_FILE_SECONDS: dict[str, float] = {}
_EXIT_STATUS = pytest.StashKey[int]()
_STARTED = time.monotonic()


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown seconds, summed per file."""
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """The suite's budget in every log (CI gives `make test` 30 minutes on a slow 2-core machine): wall time and
    the ten files that took longest (module fixtures such as a cluster's start count in their first test's
    setup)."""
    wall = time.monotonic() - _STARTED
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section("time")
    terminalreporter.write_line(f"wall time {wall / 60:.1f} min ({wall:.0f} s); test time {total:.0f} s over "
                                f"{len(_FILE_SECONDS)} files")
    terminalreporter.write_line(f"garbage collector: {_COLLECTOR.seconds:.1f} s, {_COLLECTOR.full} full "
                                f"collections, longest pause {_COLLECTOR.longest:.2f} s")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:10]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")


class _CollectorClock:
    """The cyclic garbage collector's pauses (gc.callbacks): it holds the GIL while it scans, so a long pause
    stalls every thread of the suite's process, the event loops of the routers and mock replicas a test runs
    here included. Measured with py-spy on a full run before the freezing below: one collection held the GIL
    for more than 6 s in a router test, and a test's mock request ran past its own 5 s deadline (the
    DEADLINE_EXCEEDED of test_limits that came and went between full runs, never in the module alone)."""

    def __init__(self):
        self.seconds = self.longest = 0.0
        self.full = 0
        self._started: float | None = None
        self.explicit = False

    def __call__(self, phase: str, info: dict) -> None:
        if self.explicit:  # the collections at file boundaries: between tests, they stall none
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            took = time.perf_counter() - self._started
            self.seconds += took
            self.longest = max(self.longest, took)
            self.full += info["generation"] == 2
            self._started = None


_COLLECTOR = _CollectorClock()
_frozen_at: str | None = None  # the file at whose first test survivors were last frozen


def _collect_and_freeze() -> None:
    """Collects what is garbage now, then moves every survivor to the collector's permanent generation (what a
    router or replica process does once started, engine/heap.py): later collections scan only what later tests
    create. Survivors are what lives on (libraries' modules, session fixtures, torch's and dynamo's caches); a
    frozen object still goes when its last reference does, only a reference cycle made of frozen objects stays
    until the process ends."""
    from tandem.engine.heap import settle

    _COLLECTOR.explicit = True
    try:
        settle()
    finally:
        _COLLECTOR.explicit = False


def pytest_collection_finish(session):
    """Every test module is imported now: what lives (the libraries' modules, classes and functions, ~0.4 M
    objects) lives to the end, so it is frozen, and full collections come 10x less often. Measured with
    gc.callbacks over a full run on a 2-core machine: 110 s of the suite went to the collector (~0.5 s a full
    collection), 21 s with this."""
    _collect_and_freeze()
    gc.set_threshold(700, 10, 100)
    gc.callbacks.append(_COLLECTOR)


def pytest_runtest_setup(item):
    """At the first test of each file (the last file's module fixtures are torn down by then): its garbage is
    collected and what survives it is frozen, so a full collection never scans what every earlier file left
    alive (the session's models, compiled graphs, grammars): the pauses stay those of one file's objects."""
    global _frozen_at
    path = item.nodeid.split("::")[0]
    if path != _frozen_at:
        _frozen_at = path
        _collect_and_freeze()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    """Once pytest has reported (results, summary, JUnit XML), the process ends with pytest's exit status, skipping
    the interpreter's teardown: a full run (1905 passed) once ended in a segmentation fault after its summary, with
    no Python frame (faulthandler is off by then), while the native libraries the suite loads in one process (UCX's
    progress threads, Ray's core worker, Triton, oneDNN) were torn down; the same files alone exit cleanly. The
    teardown holds no result, and a crash there must not turn a passing run into a failing one. (The frozen
    objects' finalizers do not run either, so native extensions report no leaks.)"""
    if _COLLECTOR in gc.callbacks:
        gc.callbacks.remove(_COLLECTOR)
    status = config.stash.get(_EXIT_STATUS, None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


@pytest.fixture(scope="session")
def embedded():
    from tandem.engine.loader import load_model

    return load_model(progress=False)


@pytest.fixture(scope="session")
def embedded_shape():
    """The embedded model without weights (its config and tokenizer): what manifest checks load for `embedded`."""
    from tandem.engine.loader import load_model

    return load_model(None, weights=False, progress=False)


@pytest.fixture
def embedded_shape_once(monkeypatch, embedded_shape):
    """Loading the embedded model's shape reads its GGUF header (~2 s); hand every such load in the test the
    same real result instead. Every other load goes to the real loader."""
    import tandem.engine.loader as loader

    real = loader.load_model

    def load_model(path=None, **kwargs):
        if path is None and kwargs.get("weights") is False:
            return embedded_shape
        return real(path, **kwargs)

    monkeypatch.setattr(loader, "load_model", load_model)


@pytest.fixture(scope="session")
def embedded_generator(embedded):
    from tandem.engine.core.generator import Generator

    return Generator(embedded, max_model_len=2048)


@pytest.fixture(scope="session")
def hf_embedded():
    """transformers' own GGUF loader on the same file, dequantized to float32: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.loader import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_llama(embedded, tmp_path_factory):
    """A tiny random Llama 3 (3 layers, hidden 64) with the embedded model's tokenizer: fast engine tests."""
    from tandem.engine.loader import load_model

    from tests.engine.tiny_models import write_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama3")
    write_tiny_model(folder, "llama3", embedded.tokenizer)
    return load_model(folder, progress=False)
