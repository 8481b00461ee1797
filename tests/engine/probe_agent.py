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

    def threads(self) -> tuple[int, dict[int, tuple[int, ...]]]:
        """(torch's thread count, each thread of this process -> the CPUs it may run on)."""
        import torch

        cpus = {}
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                cpus[tid] = tuple(sorted(os.sched_getaffinity(tid)))
            except ProcessLookupError:  # it ended since the listing
                pass
        return torch.get_num_threads(), cpus

    def refuse(self) -> None:
        raise LookupError(f"rank {self.rank} refuses")

    def close(self) -> None:
        self.closed = True
