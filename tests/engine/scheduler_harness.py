"""The scheduler harness of STYLE.md: a real Scheduler and KVCacheManager driven by the fake runner."""

from __future__ import annotations

from collections import defaultdict

from tandem.engine.core.kv_cache_manager import KVCacheManager
from tandem.engine.core.scheduler import Scheduler, SchedulerConfig
from tandem.engine.kv.kv_events import KVEventRecorder
from tandem.engine.request import Sequence
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler_output import SchedulerOutput

from tests.engine.fake_runner import FakeRunner


class ManualClock:
    """The scheduler's clock in a harness: seconds that pass only when a test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, *, max_model_len: int = 256,
                 eos: frozenset[int] = frozenset(), **config):
        """config: SchedulerConfig's fields (scheduling among them: the policy)."""
        self.events = KVEventRecorder()
        self.kv = KVCacheManager(num_blocks, block_size, event_sink=self.events)
        self.clock = ManualClock()
        self.scheduler = Scheduler(SchedulerConfig(max_model_len=max_model_len, **config), self.kv, eos,
                                   clock=self.clock)
        self.runner = FakeRunner(num_blocks, block_size)
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = defaultdict(list)  # seq id -> generated tokens
        self.finished: dict[str, str] = {}  # seq id -> finish reason
        self.outputs: list[SchedulerOutput] = []
        self._arrival = 0

    def add(self, request_id: str, prompt, max_tokens: int, *, priority: int = 0, n: int = 1, seed: int = 0,
            salt: str | None = None, tenant: str | None = None, **params) -> Sequence:
        sampling = SamplingParams(max_tokens=max_tokens, n=n, temperature=0, **params)
        seq = Sequence(f"{request_id}#0", request_id, 0, tuple(prompt), sampling, seed, priority, self._arrival,
                       salt, self.block_size, fork_seeds=tuple(seed + i for i in range(1, n)), tenant=tenant)
        self._arrival += 1
        self.scheduler.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        result = self.runner.execute_step(out)
        for update in self.scheduler.update(out, result):
            self.tokens[update.seq.seq_id].append(update.sampled.token_id)
            if update.status is not None:
                self.finished[update.seq.seq_id] = update.status.finish_reason
        self.scheduler.check_integrity()
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError(f"still unfinished after {max_steps} steps")
