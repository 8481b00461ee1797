"""The driver side of a replica that spans processes: starts the ranks, sends them each step, collects the
sampled tokens, and turns any rank's failure into ReplicaFailedError instead of a hang.

It has the runner's interface (`execute_step(SchedulerOutput) -> RunnerOutput`), so LLMEngine steps a
multi-process replica exactly as it steps a single-process one. Ranks are spawned processes here; a later issue
starts `run_worker` inside Ray actors with the same messages.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from multiprocessing.connection import Connection, wait
from typing import Callable, Mapping, TypeVar

from tandem.engine.errors import ReplicaFailedError
from tandem.engine.hardware.device import RankPlacement
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.engine.runner.ranks.messages import (AgentAnswer, AgentCall, Allocate, GetStats, Memory, RankError,
                                                 RankStats, Ready, Step, StepResult, Stop)
from tandem.engine.runner.ranks.worker import WorkerSpec, run_worker
from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput, TierReport

__all__ = ["MultiprocExecutor", "ReplicaFailedError", "free_port"]

T = TypeVar("T")
M = TypeVar("M")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec, kv_blocks: Callable[[int], int], *, startup_timeout_s: float = 600.0):
        """Spawns spec.layout.world_size ranks and waits until every one has loaded its shard and allocated its
        KV cache: each rank reports its device's free memory once its shard is loaded, and kv_blocks(the
        smallest of those, bytes) sets every rank's block count (num_kv_blocks). Raises ReplicaFailedError (and
        stops the others) if any rank fails to start, ValueError (the ranks stopped) if kv_blocks does."""
        import torch.multiprocessing as mp

        self.layout: ReplicaLayout = spec.layout
        self.spec = spec
        self.step_timeout_s = 2 * spec.timeout_s
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        self._prev_tokens: dict[str, tuple[int, ...]] = {}
        self._dead = False
        for rank in range(self.layout.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(rank, spec, child), name=f"tandem-rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        ranks = list(range(self.layout.world_size))
        deadline = time.monotonic() + startup_timeout_s
        free = self._collect(ranks, Memory, deadline)
        try:
            self.num_kv_blocks = kv_blocks(min(m.free_bytes for m in free.values()))
        except ValueError:
            self.shutdown(graceful=False)
            raise
        self._broadcast(Allocate(self.num_kv_blocks))
        ready = self._collect(ranks, Ready, deadline)
        self.placements: tuple[RankPlacement, ...] = tuple(ready[r].placement for r in ranks)

    def _describe(self, rank: int) -> str:
        stage, ep, tp = self.layout.coords(rank)
        return f"rank {rank} (stage {stage}, ep {ep}, tp {tp})"

    def _fail(self, message: str) -> None:
        self.shutdown(graceful=False)
        raise ReplicaFailedError(message)

    def _collect(self, ranks: list[int], kind: type[M], deadline: float) -> dict[int, M]:
        """Waits until each of `ranks` has sent a message of type `kind`; returns them by rank. An error from any
        rank, a message nobody waits for, a rank's death or the deadline fails the replica."""
        waiting, got = set(ranks), {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"{self._describe(min(waiting))} did not answer within the timeout (waiting for "
                           f"{kind.__name__})")
            ready = wait(self._conns + [p.sentinel for p in self._procs], timeout=left)
            for item in ready:
                if item in self._conns:
                    rank = self._conns.index(item)
                    try:
                        message = item.recv()
                    except (EOFError, OSError):  # it died: say which, with its exit code when known
                        self._procs[rank].join(timeout=1)
                        message = RankError(f"{self._describe(rank)} is gone (exit code "
                                            f"{self._procs[rank].exitcode}, pid {self._procs[rank].pid})")
                    if isinstance(message, RankError):
                        self._fail(message.text)
                    if not isinstance(message, kind) or rank not in waiting:
                        self._fail(f"{self._describe(rank)} sent an unexpected {type(message).__name__}")
                    got[rank] = message
                    waiting.discard(rank)
            for item in ready:
                if item not in self._conns:
                    rank = next(r for r, p in enumerate(self._procs) if p.sentinel == item)
                    if self._conns[rank].poll():  # it said why before it exited: read that first
                        continue
                    self._fail(f"{self._describe(rank)} exited with code {self._procs[rank].exitcode} "
                               f"(killed or crashed; pid {self._procs[rank].pid})")
        return got

    def _broadcast(self, message: Allocate | Step | GetStats) -> None:
        if self._dead:
            raise ReplicaFailedError("the replica has been shut down")
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self._fail(f"{self._describe(rank)} is gone (its pipe is closed)")

    def execute_step(self, output: SchedulerOutput) -> RunnerOutput:
        """Runs one step on every rank; returns the sampler rank's RunnerOutput (with every rank's failed disk copies
        when the step had any)."""
        self._broadcast(Step(self._prev_tokens, output))
        sampler = self.layout.sampler_rank
        reporting = list(range(self.layout.world_size)) if output.tier_ops.reports else [sampler]
        answers = self._collect(reporting, StepResult, time.monotonic() + self.step_timeout_s)
        result = answers[sampler].output
        if len(answers) > 1:  # a disk copy may fail on any rank's share of a block: the block fails on all
            failed = dict.fromkeys(f for answer in answers.values() for f in answer.output.tiers.failed)
            result = result.with_tiers(TierReport(tuple(failed), result.tiers.times))
        self._prev_tokens = {seq_id: result.token_ids(seq_id) for seq_id in result.sampled}
        return result

    def call_agents(self, fn: Callable[..., T], args_by_rank: Mapping[int, tuple]) -> dict[int, T]:
        """Runs fn(agent, *args) on the KV transfer agent of each named rank, in its process; results by rank.
        fn and args must pickle (fn: a module-level function or an unbound method, pickled by qualified name);
        one that does not raises before any rank is asked. An exception fn raises on a rank is raised here (the
        first by rank) and the rank lives on; a rank that dies fails the replica (ReplicaFailedError)."""
        if self._dead:
            raise ReplicaFailedError("the replica has been shut down")
        payloads = {rank: pickle.dumps(AgentCall(fn, args), protocol=pickle.HIGHEST_PROTOCOL)
                    for rank, args in args_by_rank.items()}
        for rank, payload in payloads.items():
            try:
                self._conns[rank].send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self._fail(f"{self._describe(rank)} is gone (its pipe is closed)")
        answers: dict[int, AgentAnswer] = self._collect(list(payloads), AgentAnswer,
                                                         time.monotonic() + self.step_timeout_s)
        for rank, answer in sorted(answers.items()):
            if answer.raised:
                raise answer.value
        return {rank: answer.value for rank, answer in answers.items()}

    def rank_stats(self) -> list[RankStats]:
        """Each rank's memory, time split and expert load, in rank order."""
        self._broadcast(GetStats())
        stats = self._collect(list(range(self.layout.world_size)), RankStats, time.monotonic() + self.step_timeout_s)
        return [stats[rank] for rank in range(self.layout.world_size)]

    def step_version(self) -> int:
        return 0  # the ranks compile before serving, if at all: their step never changes

    def ranks_alive(self) -> list[bool]:
        """Whether each rank's process runs, in rank order. Safe from any thread: it only looks at them."""
        return [proc.is_alive() for proc in self._procs]

    def dead_ranks(self) -> list[str]:
        """The ranks whose process has exited, described (empty once shut down: they were stopped)."""
        if self._dead:
            return []
        return [f"{self._describe(rank)} (pid {proc.pid}, exit code {proc.exitcode})"
                for rank, (proc, alive) in enumerate(zip(self._procs, self.ranks_alive())) if not alive]

    def rank_rss_bytes(self) -> list[int | None]:
        """Resident memory of each rank's process (None where the OS does not say), read from /proc."""
        sizes: list[int | None] = []
        for proc in self._procs:
            try:
                status = open(f"/proc/{proc.pid}/status").read()
                sizes.append(next(int(line.split()[1]) * 1024 for line in status.splitlines()
                                  if line.startswith("VmRSS:")))
            except (OSError, StopIteration, ValueError):
                sizes.append(None)
        return sizes

    def shutdown(self, graceful: bool = True) -> None:
        """Stops every rank (idempotent). Graceful: ask, wait a little, then kill."""
        if self._dead:
            return
        self._dead = True
        if graceful:
            payload = pickle.dumps(Stop())
            for conn in self._conns:
                try:
                    conn.send_bytes(payload)
                except OSError:
                    pass
            deadline = time.monotonic() + 10
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()

    def kill_rank(self, rank: int) -> None:
        """Kills one rank's process (SIGKILL): for failure tests and chaos drills."""
        os.kill(self._procs[rank].pid, 9)

    def __del__(self):
        try:
            self.shutdown(graceful=False)
        except Exception:
            pass
