"""The benchmark peers of bench/peers/: installed by `make bench-peers`, never needed by `make test`."""

from __future__ import annotations

import sys

import pytest

from bench.peers import llama_cpp_peer as llama_cpp


def test_a_missing_peer_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as on a machine where `make bench-peers` never ran
    with pytest.raises(ImportError, match="make bench-peers"):
        llama_cpp.load("model.gguf", threads=1, n_ctx=64)


def test_a_measurement_runs_in_a_process_of_its_own_and_says_why_it_failed():
    """On a machine without the peer the subprocess's install message comes back as the error; with it, one
    batch-1 measurement of a short prompt comes back as a rate."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        with pytest.raises(RuntimeError, match="make bench-peers"):
            llama_cpp.measure("batch1", [[1, 2, 3]], tokens=4, threads=1)
    else:
        assert llama_cpp.measure("batch1", [[1, 2, 3]], tokens=4, threads=1)["tokens_per_s"] > 0
