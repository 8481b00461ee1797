"""What crosses the pipe between a multi-process replica's driver (engine/runner/ranks/executor.py) and its ranks
(engine/runner/ranks/worker.py): one frozen dataclass per message, so both sides name what they send by type, never
by a string.

Driver -> rank: Allocate (the KV cache's size, once, at start-up), Step (every rank, each engine step),
GetStats, AgentCall (the ranks it names) and Stop. Rank -> driver: Memory and Ready (start-up), StepResult (the
sampler rank, each step), RankStats, AgentAnswer and RankError (a rank that fails sends it and exits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tandem.engine.hardware.device import RankPlacement
from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class Allocate:
    num_blocks: int  # every rank's KV cache, sized by the driver from the smallest Memory


@dataclass(frozen=True)
class Step:
    prev_tokens: dict[str, tuple[int, ...]]  # each sequence's tokens sampled last step (the non-sampler ranks')
    schedule: SchedulerOutput


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class AgentCall:
    """Runs fn(agent, *args) on the rank's KV transfer agent. fn is a picklable callable (a module-level
    function, or an unbound method such as KVTransferAgent.expect, which pickles by its qualified name)."""

    fn: Callable[..., Any]
    args: tuple


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Memory:
    free_bytes: int  # the rank's device, once its shard is loaded


@dataclass(frozen=True)
class Ready:
    placement: RankPlacement


@dataclass(frozen=True)
class StepResult:
    output: RunnerOutput


@dataclass(frozen=True)
class RankStats:
    """What one rank holds and where its time went (seconds since start)."""

    rank: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_cache_shape: tuple[int, ...]
    step_s: float
    forward_s: float
    num_steps: int
    comm_s: dict[str, float]
    expert_load: dict[int, int]


@dataclass(frozen=True)
class AgentAnswer:
    """fn's result, or (raised) the exception it raised: the agent's own errors go back to the caller, and the
    rank lives on."""

    value: Any
    raised: bool = False


@dataclass(frozen=True)
class RankError:
    text: str  # where and what, with the traceback
