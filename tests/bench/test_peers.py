"""The benchmark peers of bench/peers/: installed by `make bench-peers`, never needed by `make test`."""

from __future__ import annotations

import sys

import pytest

from bench.peers import llama_cpp_peer as llama_cpp


def test_a_missing_peer_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as on a machine where `make bench-peers` never ran
    with pytest.raises(ImportError, match="make bench-peers"):
        llama_cpp.load("model.gguf", threads=1, n_ctx=64)
