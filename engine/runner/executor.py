"""How the engine runs a step: the Executor protocol, and its one-process implementation.

LLMEngine steps its scheduler and hands each SchedulerOutput to an Executor, which runs it wherever the model
lives and answers the RunnerOutput: LocalExecutor over a ModelRunner in this process, or the MultiprocExecutor
(engine/runner/ranks/executor.py) over the rank processes of a replica split by engine/parallel/layout.py. Both also
run calls beside each rank's KV transfer agent, say where each rank runs and whether it still does, and stop.
engine/runner/builder.py builds the one a configuration asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, TypeVar

if TYPE_CHECKING:
    from tandem.engine.hardware.device import RankPlacement
    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput

T = TypeVar("T")


class Executor(Protocol):
    num_kv_blocks: int  # every rank's KV cache holds this many blocks (block ids are global)
    placements: tuple[RankPlacement, ...]  # where each rank runs, in rank order

    def execute_step(self, output: SchedulerOutput) -> RunnerOutput:
        """Runs one step on every rank; the sampling rank's answer."""

    def call_agents(self, fn: Callable[..., T], args_by_rank: Mapping[int, tuple]) -> dict[int, T]:
        """fn(agent, *args) beside each named rank's KV transfer agent; the results by rank."""

    def ranks_alive(self) -> list[bool]:
        """Whether each rank still runs, in rank order (safe from any thread)."""

    def step_version(self) -> int:
        """Changes when the step the ranks run changes cost: 1 once `compile: background`'s compiled step has
        replaced the eager one, else 0 (the speculator's step costs describe the step they timed)."""

    def dead_ranks(self) -> list[str]:
        """The ranks that have exited, described (safe from any thread)."""

    def shutdown(self) -> None:
        """Stops the ranks and the KV transfer agents (idempotent)."""


class LocalExecutor:
    """One rank, in this process: the runner, and the KV transfer agent beside its cache (None without one:
    LLMEngine.call_kv_agents refuses the call then)."""

    def __init__(self, runner: ModelRunner, agent: Any, placement: RankPlacement):
        self.runner = runner
        self.agent = agent
        self.num_kv_blocks = runner.kv_cache.spec.num_blocks
        self.placements = (placement,)

    def execute_step(self, output: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute_step(output)

    def call_agents(self, fn: Callable[..., T], args_by_rank: Mapping[int, tuple]) -> dict[int, T]:
        return {rank: fn(self.agent, *args) for rank, args in args_by_rank.items()}

    def ranks_alive(self) -> list[bool]:
        return [True]

    def step_version(self) -> int:
        return int(self.runner.compiled is not None)

    def dead_ranks(self) -> list[str]:
        return []

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.runner.tiers is not None:
            self.runner.tiers.close()

