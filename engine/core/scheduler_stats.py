"""What a scheduler's counters say after a step (Scheduler.stats(); the replica's stats and metrics read them), and
whether its state is consistent (Scheduler.check_integrity())."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.core.kv_tiers import TierStats
from tandem.engine.request import RequestStatus


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


def check_state(scheduler) -> None:
    """Raises ValueError if the Scheduler's KV ownership is inconsistent or a sequence is in the wrong place."""
    scheduler.kv.check_integrity()
    for seq in scheduler.running:
        if seq.status is not RequestStatus.RUNNING or seq.seq_id not in scheduler.seqs:
            raise ValueError(f"running sequence {seq.seq_id} has status {seq.status}")
    for seq in scheduler.waiting:
        if scheduler.kv.block_table(seq.seq_id) and seq.seq_id not in scheduler.loaded:
            raise ValueError(f"waiting sequence {seq.seq_id} holds blocks")
    for seq in scheduler.reserved.values():
        if seq.status is not RequestStatus.WAITING_FOR_KV or len(scheduler.kv.block_table(seq.seq_id)) < \
                scheduler.kv.blocks_for(seq.num_prompt_tokens):
            raise ValueError(f"reserved sequence {seq.seq_id} has status {seq.status} or too few blocks")
    queued = len(scheduler.running) + len(scheduler.waiting) + len(scheduler.reserved)
    if scheduler.loading or queued != len(scheduler.seqs):
        raise ValueError("a sequence is in more than one of running, waiting and reserved, or in none (or loading "
                         "from a KV tier between steps)")
