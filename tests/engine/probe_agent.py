"""A stand-in KV transfer agent for engine tests: LLMEngine(kv_agent=ProbeAgent) builds one beside each rank's KV
store (in the rank's process), and call_kv_agents reaches its methods by reference. Its own module, so that a
spawned rank unpickles it without importing a test file."""

from __future__ import annotations

import os


class ProbeAgent:
    def __init__(self, rank: int, layout, kv_cache):
        self.rank = rank
        self.kv_shape = tuple(kv_cache.data.shape)
        self.closed = False

    def on_layers_done(self, layer: int, tables) -> None:
        pass

    def where(self, tag: str) -> tuple[int, int, tuple[int, ...], str]:
        """(rank, process id, shape of the KV store beside it, tag)."""
        return self.rank, os.getpid(), self.kv_shape, tag

    def refuse(self) -> None:
        raise LookupError(f"rank {self.rank} refuses")

    def close(self) -> None:
        self.closed = True
