"""One rank's communicators: its TP group, its EP group and point-to-point sends between pipeline stages.

Backends: gloo on the CPU, NCCL on GPUs, both through torch.distributed. Every call is timed, so a benchmark can
report the share of a step spent communicating (`seconds`). Every collective is bounded by the process group's
timeout: a rank that dies makes its peers raise instead of hang.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.engine.parallel.layout import ReplicaLayout


class ParallelComm:
    """Collectives of one rank. Construct on every rank of the replica in the same order (group creation is
    itself a collective)."""

    def __init__(self, layout: ReplicaLayout, rank: int, *, init_method: str, timeout_s: float,
                 backend: str | None = None, device: torch.device | str = "cpu"):
        self.layout = layout
        self.rank = rank
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=layout.world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.stage, self.ep_index, self.tp_index = layout.coords(rank)
        # new_group is collective over the whole world: every rank creates every group, in the same order.
        self.tp_group = self.ep_group = None
        for stage in range(layout.pp):
            for e in range(layout.ep):
                group = dist.new_group(list(layout.tp_group(stage, e))) if layout.tp > 1 else None
                if (stage, e) == (self.stage, self.ep_index):
                    self.tp_group = group
            for t in range(layout.tp):
                group = dist.new_group(list(layout.ep_group(stage, t))) if layout.ep > 1 else None
                if (stage, t) == (self.stage, self.tp_index):
                    self.ep_group = group
        self.seconds: dict[str, float] = defaultdict(float)

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @contextmanager
    def _timed(self, kind: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - start

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the TP group in place and returns it."""
        if self.tp_group is not None:
            with self._timed("tp_all_reduce"):
                dist.all_reduce(x, group=self.tp_group)
        return x

    def all_to_all_ep(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int]) -> torch.Tensor:
        """Rows input[sum(input_splits[:i]) : ...] go to EP index i; output receives EP index i's rows in order."""
        with self._timed("ep_all_to_all"):
            dist.all_to_all_single(output, input, output_splits, input_splits, group=self.ep_group)
        return output

    def all_gather_ep(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every EP index's x (same shape everywhere), in EP order."""
        out = [torch.empty_like(x) for _ in range(self.ep_size)]
        with self._timed("ep_all_gather"):
            dist.all_gather(out, x, group=self.ep_group)
        return out

    def send_next(self, x: torch.Tensor) -> dist.Work:
        """Starts sending x to the same (ep, tp) slot of the next stage; wait() on the result before reusing x."""
        with self._timed("pp_send"):
            return dist.isend(x.contiguous(), self.layout.rank(self.stage + 1, self.ep_index, self.tp_index))

    def recv_prev(self, x: torch.Tensor) -> dist.Work:
        """Starts receiving into x from the same (ep, tp) slot of the previous stage."""
        return dist.irecv(x, self.layout.rank(self.stage - 1, self.ep_index, self.tp_index))

    def wait(self, work: dist.Work) -> None:
        with self._timed("pp_wait"):
            work.wait()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
