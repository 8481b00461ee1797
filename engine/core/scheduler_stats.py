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


def collect_stats(scheduler) -> SchedulerStats:
    """What a Scheduler's counters, queues and KV pool say now (engine/core/scheduler.py: it calls this)."""
    kv, queried = scheduler.kv, scheduler.num_prompt_tokens_queried
    return SchedulerStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), num_blocks_total=kv.pool.num_blocks,
        num_blocks_in_use=kv.pool.num_in_use, num_blocks_cached=len(kv.cache), kv_usage=kv.usage(),
        prefix_hit_rate=scheduler.num_prompt_tokens_cached / queried if queried else 0.0,
        num_preemptions=scheduler.num_preemptions, num_prompt_tokens_queried=queried,
        num_prompt_tokens_cached=scheduler.num_prompt_tokens_cached, num_tokens_computed=scheduler.num_tokens_computed,
        num_waiting_for_kv=len(scheduler.reserved), num_prompt_tokens_from_tiers=scheduler.num_prompt_tokens_from_tiers,
        tiers=kv.tiers.stats() if kv.tiers is not None else None)
