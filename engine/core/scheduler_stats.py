"""What a scheduler's counters say after a step (Scheduler.stats(); the replica's stats and metrics read them)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.core.kv_tiers import TierStats


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_blocks_cached: int  # blocks holding a registered prefix (in use or parked)
    kv_usage: float  # in-use blocks / total
    prefix_hit_rate: float  # prompt tokens served from cache / prompt tokens looked up, at first scheduling
    num_preemptions: int
    num_prompt_tokens_queried: int
    num_prompt_tokens_cached: int
    num_tokens_computed: int  # tokens the model computed (prefill chunks + decodes)
    num_waiting_for_kv: int = 0  # sequences holding reserved blocks until their KV arrives
    num_prompt_tokens_from_tiers: int = 0  # of num_prompt_tokens_cached: copied up from a KV tier
    tiers: TierStats | None = None  # None: no KV tiers
