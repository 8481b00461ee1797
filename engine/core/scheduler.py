"""Iteration-level scheduler: every step, one batch under a token budget and a sequence cap.

Order within a step, each group in the policy's order (engine/core/scheduling_policy.py; by default priority,
lower value first, then arrival; fair also caps each tenant's prompt tokens in the step at its share):
  1. running sequences that are decoding (one token each), then those still prefilling (a chunk each, as budget allows);
  2. an urgent waiting sequence (priority preemption, when configured) preempting running ones of lower priority;
  3. if nobody had to be preempted in (1), waiting sequences, each with its prefix-cache hit taken first, while
     blocks, budget and the sequence cap allow. The first one that cannot start blocks the rest.
When a running sequence cannot get a block, the running sequence last in order gives all its blocks back
(preemption by recompute) and waits again; it may be the one asking.

With a Speculator (engine/decoding/speculation.py), decoding sequences also compute proposed tokens picked before (1)
(none, adaptively, in a step with a prompt chunk; dropped first when blocks or budget run short); update() advances
by accepted tokens only (no computed count, prefix hash or token sees a rejected proposal), freeing rejected blocks.

With KV tiers (engine/core/kv_tiers.py), a waiting sequence whose prefix goes on past the pool's blocks on a tier
takes blocks for that run and its first chunk and is WAITING_FOR_TIER while the step copies it up; update() puts it
back in the queue, holding them, with the run computed up to the first block a disk read failed for.

A sequence whose prompt KV arrives by transfer skips the queue: reserve() gives it blocks for the whole prompt and
parks it in WAITING_FOR_KV (never scheduled nor preempted; once it waited preempt_after_s for room elsewhere, it
preempts running sequences of lower priority as an urgent one does); admit_transferred() makes it RUNNING with its
prompt computed and its first token (sampled by the prefill replica) appended, or (a prefix pulled from another
replica) ends it with its blocks cached. At most max_loras LoRA adapters run or wait for KV at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tandem.engine.core.kv_cache_manager import NO_MATCH, Allocation, KVCacheManager
from tandem.engine.core.scheduler_stats import SchedulerStats, check_state, collect_stats
from tandem.engine.core.scheduling_policy import NO_SHARES, SchedulingPolicy, WaitingQueue
from tandem.engine.engine_config import SchedulerConfig
from tandem.engine.errors import RequestRejectedError
from tandem.engine.request import RequestStatus, Sequence, token_stop_status
from tandem.engine.sampled_token import SampledToken
from tandem.engine.scheduler_output import (CachedSequenceData, ForkData, NewSequenceData, RunnerOutput,
                                            SchedulerOutput, TierReport)

if TYPE_CHECKING:
    from tandem.engine.decoding.speculation import Speculator


@dataclass(frozen=True)
class SeqUpdate:
    """One sequence's new token after a step; status is its finished status when this token ended it."""

    seq: Sequence
    sampled: SampledToken
    status: RequestStatus | None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: frozenset[int] = frozenset(),
                 speculator: Speculator | None = None, *, clock: Callable[[], float] = time.monotonic):
        """clock: what the policy measures waiting with (seconds). Raises ValueError for a policy setting that
        contradicts itself."""
        self.config = config
        self.speculator = speculator
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = SchedulingPolicy(config.scheduling, clock)
        self._shares = NO_SHARES  # this step's prompt tokens per tenant (fair)
        self.waiting = WaitingQueue()  # in the policy's order
        self.running: list[Sequence] = []
        self.reserved: dict[str, Sequence] = {}  # WAITING_FOR_KV, by seq id
        # WAITING_FOR_TIER between a step's schedule() and update(): (seq, first tier block, tier blocks, status)
        self.loading: dict[str, tuple[Sequence, int, int, RequestStatus]] = {}
        self.loaded: set[str] = set()  # waiting sequences holding blocks copied up from a tier
        self.hold_after: dict[str, str] = {}  # request id -> the key its blocks are held under when freed
        self.seqs: dict[str, Sequence] = {}
        self._by_request: dict[str, list[str]] = {}
        self._dropped: set[str] = set()  # runner state to forget at the next step
        self._resend: set[str] = set()  # sequences the runner must get in full at their next scheduling
        self._trimmed: set[str] = set()  # sequences whose block table shrank: the runner gets the whole table next
        self.num_preemptions = 0
        self.num_prompt_tokens_queried = 0
        self.num_prompt_tokens_cached = 0
        self.num_tokens_computed = 0
        self.num_prompt_tokens_from_tiers = 0

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raises RequestRejectedError if a request of this size (n samples) can never run, however idle the
        engine. Cheap: callers check before they build anything per sample."""
        if n > self.config.max_num_seqs:
            raise RequestRejectedError(f"n={n} samples exceed max_num_seqs ({self.config.max_num_seqs})")
        total = num_prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            raise RequestRejectedError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the maximum "
                f"context length {self.config.max_model_len}; shorten the prompt or lower max_tokens")
        if self.kv.blocks_for(total) > self.kv.num_blocks:
            raise RequestRejectedError(
                f"prompt + max_tokens = {total} tokens needs {self.kv.blocks_for(total)} KV blocks but the whole "
                f"KV cache has {self.kv.num_blocks}; lower max_tokens or give the engine a larger KV budget")

    def add(self, seq: Sequence) -> None:
        """Queues sample 0 of a request (its other samples are forked from it). Raises RequestRejectedError
        when it can never fit, ValueError for a request id in use; nothing is queued then."""
        self._check_new(seq)
        self._track(seq)
        self.policy.enqueue(seq, self.waiting)

    def _check_new(self, seq: Sequence) -> None:
        if seq.request_id in self._by_request:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.check_admissible(seq.num_prompt_tokens, seq.params.max_tokens, 1 + len(seq.fork_seeds))

    def _track(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self._by_request[seq.request_id] = [seq.seq_id]
        self._resend.add(seq.seq_id)

    def reserve(self, seq: Sequence, cached: bool = False, waited_s: float = 0.0) -> tuple[int, ...] | None:
        """Takes blocks for seq's whole prompt (cached: its cached prefix's own, the rest new) and parks it in
        WAITING_FOR_KV (its KV will be written by a transfer). Returns its block table, or None when there is no
        room now (nothing changes; try later or elsewhere). waited_s: its wait for room elsewhere (the module
        doc). Raises like add(), and ValueError for n > 1."""
        self._check_new(seq)
        if seq.fork_seeds:
            raise ValueError("a request whose KV arrives by transfer must have n=1")
        victims = self.policy.victims(self.running, seq) if self.policy.overdue(waited_s) else []
        while True:
            match = self.kv.match_prefix(seq) if cached else NO_MATCH
            if self._fits(seq, False) and self.kv.allocate(seq, seq.num_prompt_tokens - match.num_cached_tokens,
                                                           match) is not None:
                break
            if not victims:
                return None
            self._preempt(victims.pop(0))
        seq.status = RequestStatus.WAITING_FOR_KV
        self.policy.assign(seq)
        self._track(seq)
        self.reserved[seq.seq_id] = seq
        return tuple(self.kv.block_table(seq.seq_id))

    def admit_transferred(self, request_id: str, sampled: SampledToken | None) -> SeqUpdate | None:
        """Starts a reserved sequence whose prompt KV has arrived: all prompt tokens count as computed (its full
        blocks enter the prefix cache) and `sampled` (the token the prefill replica drew) is its first
        output token. Returns that token's update; the sequence may finish on it (stop token, max_tokens=1).
        sampled None: the KV is a prefix to keep, no request: the sequence ends, its blocks parked, cached.
        Raises KeyError if the request holds no reservation."""
        ids = self._by_request.get(request_id, ())
        seq = self.reserved.get(ids[0]) if ids else None
        if seq is None:
            raise KeyError(f"request {request_id!r} holds no KV reservation")
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.cache_full_blocks(seq)
        if sampled is None:
            return self.finish(seq, RequestStatus.FINISHED_ABORTED)
        del self.reserved[seq.seq_id]
        seq.status = RequestStatus.RUNNING
        self.num_prompt_tokens_queried += seq.num_prompt_tokens
        self.running.append(seq)
        seq.append_token(sampled.token_id)
        status = token_stop_status(seq, self.eos_token_ids, self.config.max_model_len)
        if status is not None:
            self.finish(seq, status)
        return SeqUpdate(seq, sampled, status)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finishes every unfinished sample of the request as aborted, freeing its blocks now. Returns them."""
        aborted = []
        for seq_id in list(self._by_request.get(request_id, ())):
            seq = self.seqs[seq_id]
            self.finish(seq, RequestStatus.FINISHED_ABORTED)
            aborted.append(seq)
        return aborted

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Ends a sequence (stop string, abort, ...): frees its blocks and forgets it."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(seq)
        elif seq.status is RequestStatus.WAITING_FOR_KV:
            del self.reserved[seq.seq_id]
        elif seq.status is RequestStatus.WAITING_FOR_TIER:
            del self.loading[seq.seq_id]
        self.loaded.discard(seq.seq_id)
        self._free(seq)
        seq.status = status
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.seqs.pop(seq.seq_id, None)
        ids = self._by_request.get(seq.request_id, [])
        if seq.seq_id in ids:
            ids.remove(seq.seq_id)
        if not ids:
            self._by_request.pop(seq.request_id, None)
        self._resend.discard(seq.seq_id)
        self._trimmed.discard(seq.seq_id)
        self._dropped.add(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def has_schedulable(self) -> bool:
        """Whether schedule() has sequences to pick: waiting or running ones (WAITING_FOR_KV ones are parked)."""
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        allocations: dict[str, Allocation] = {}
        preempted = False
        self.kv.save_parked()
        self.policy.age(self.waiting)
        self._shares = self.policy.shares(budget, self.running, self.waiting, self._fits)
        prefills = self.speculator is not None and (  # a prompt chunk joins the step: speculation sits it out
            any(s.is_prefilling for s in self.running) or bool(self.waiting) and self._fits(self.waiting[0]))
        spec = self.speculator.propose(self.running, self.config.max_model_len, prefills) if self.speculator else {}
        ahead = None  # sjf: prompt tokens of waiting sequences that go before the running prompts' chunks
        for seq in sorted(self.running, key=lambda s: (s.is_prefilling, s.order)):
            if budget == 0:
                break
            if seq.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier sequence of this loop
            if seq.is_prefilling and ahead is None:
                ahead = self.policy.ahead_of(seq, self.waiting, budget, self._fits)
            room = max(0, budget - ahead) if seq.is_prefilling else budget
            count = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, room)
            if not count:
                continue
            if (proposed := spec.pop(seq.seq_id, ())) and (extra := min(len(proposed), budget - count)) > 0:
                allocation = self.kv.allocate(seq, count + extra)
                if allocation is not None:  # else: no room for the proposals, decode without them
                    spec[seq.seq_id] = proposed[:extra]
                    scheduled[seq.seq_id], allocations[seq.seq_id] = count + extra, allocation
                    budget -= count + extra
                    continue
            while (allocation := self.kv.allocate(seq, count)) is None:
                victim = max(self.running, key=lambda s: s.order)
                budget += self._preempt(victim, scheduled, allocations)
                preempted = True
                if victim is seq:
                    break
            if allocation is None:
                continue
            scheduled[seq.seq_id], allocations[seq.seq_id] = count, allocation
            self._shares.take(seq, count)
            budget -= count
        if (urgent := self.policy.urgent(self.waiting, self.running)) is not None:
            budget = self._start_urgent(urgent, budget, scheduled, allocations)
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, allocations)
        return self._build_output(scheduled, allocations, {i: t for i, t in spec.items() if i in scheduled})

    def _chunk(self, seq: Sequence, remaining: int, budget: int, shared: bool = True) -> int:
        """Tokens of seq to compute this step: all that remain, or a budget-sized chunk if chunking is on; a
        prompt's within its tenant's share of the step (fair: scheduling_policy.StepShares) unless not shared."""
        budget = self._shares.allow(seq, budget) if remaining > 1 and shared else budget
        return remaining if remaining <= budget else budget if self.config.enable_chunked_prefill else 0

    def _admit_waiting(self, budget: int, scheduled: dict[str, int], allocations: dict[str, Allocation]) -> int:
        # Sequences whose prefix came up from a tier go first, wherever they wait: they hold their blocks, their
        # first chunk's included (taken as they loaded), so they never wait for anyone's and never block anyone.
        for seq in [s for s in self.waiting if s.seq_id in self.loaded]:
            if budget == 0 or not self._fits(seq):
                break
            room = len(self.kv.block_table(seq.seq_id)) * self.kv.block_size - seq.num_computed_tokens
            count = min(self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget), room)
            if count and (allocation := self.kv.allocate(seq, count)) is not None:
                self.waiting.remove(seq)
                self.loaded.discard(seq.seq_id)
                budget -= self._start(seq, count, allocation, scheduled, allocations)
        for seq in [s for s in self.waiting if s.seq_id not in self.loaded]:
            if budget == 0 or not self._fits(seq):
                break
            if not self._shares.allow(seq, budget):
                continue  # fair: its tenant's share of this step is spent; another tenant's request may go
            match = self.kv.match_prefix(seq)
            if tier_blocks := self.kv.match_tiers(seq, match):
                rest = seq.num_tokens - (len(match.blocks) + tier_blocks) * self.kv.block_size
                first_chunk = min(rest, budget) if self.config.enable_chunked_prefill else rest
                if self.kv.allocate(seq, tier_blocks * self.kv.block_size + first_chunk, match) is None:
                    break
                self.kv.load_from_tiers(seq, len(match.blocks), tier_blocks)
                self.waiting.remove(seq)
                self.loading[seq.seq_id] = (seq, len(match.blocks), tier_blocks, seq.status)
                seq.status = RequestStatus.WAITING_FOR_TIER
                continue
            count = self._chunk(seq, seq.num_tokens - match.num_cached_tokens, budget)
            if not count or (allocation := self.kv.allocate(seq, count, match)) is None:
                break
            budget -= self._admit(seq, count, match.num_cached_tokens, allocation, scheduled, allocations)
        return budget

    def _start_urgent(self, seq: Sequence, budget: int, scheduled: dict[str, int],
                      allocations: dict[str, Allocation]) -> int:
        """Priority preemption (scheduling_policy.py): preempts seq's victims one by one until seq can start,
        and starts it; returns the budget left (a victim scheduled this step gives its tokens back)."""
        victims = self.policy.victims(self.running, seq)
        while True:
            match = self.kv.match_prefix(seq)
            count = self._chunk(seq, seq.num_tokens - match.num_cached_tokens, budget, shared=False)  # priority first
            if count and self._fits(seq) and (allocation := self.kv.allocate(seq, count, match)) is not None:
                return budget - self._admit(seq, count, match.num_cached_tokens, allocation, scheduled, allocations)
            if not victims:
                return budget
            budget += self._preempt(victims.pop(0), scheduled, allocations)

    def _admit(self, seq: Sequence, count: int, cached: int, allocation: Allocation, scheduled: dict[str, int],
               allocations: dict[str, Allocation]) -> int:
        """Starts a waiting sequence with its first `cached` tokens from the prefix cache; returns count."""
        self.waiting.remove(seq)
        if seq.status is RequestStatus.WAITING:  # (a resumed one's cached outputs are not prompt tokens)
            seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            self.num_prompt_tokens_queried += seq.num_prompt_tokens
            self.num_prompt_tokens_cached += seq.num_cached_tokens
        seq.num_computed_tokens = cached
        return self._start(seq, count, allocation, scheduled, allocations)

    def _fits(self, seq: Sequence, count_seqs: bool = True) -> bool:
        """Whether seq (and its forks) may start now: the sequence cap, and max_loras adapters running or reserved."""
        if count_seqs and len(self.running) + 1 + len(seq.fork_seeds) > self.config.max_num_seqs:
            return False
        return seq.params.lora is None or len(  # a base-model sequence adds no adapter
            {s.params.lora for s in (*self.running, *self.reserved.values(), seq)} - {None}) <= self.config.max_loras

    def _start(self, seq: Sequence, count: int, allocation: Allocation, scheduled: dict[str, int],
               allocations: dict[str, Allocation]) -> int:
        """Makes a waiting sequence running with count tokens scheduled; returns count."""
        self.policy.started(seq)
        self._shares.take(seq, count)
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        scheduled[seq.seq_id], allocations[seq.seq_id] = count, allocation
        return count

    def _free(self, seq: Sequence) -> None:
        """Frees seq's blocks, keeping them held under its request id if the request asked (hold_after)."""
        if (key := self.hold_after.get(seq.request_id)) is not None:
            self.kv.hold(seq, key)
        self.kv.free(seq)

    def _preempt(self, seq: Sequence, scheduled: dict[str, int] | None = None,
                 allocations: dict[str, Allocation] | None = None) -> int:
        """Preempts a running sequence by recompute; returns the step's tokens it had scheduled (now given back)."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = RequestStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._dropped.add(seq.seq_id)
        self._resend.add(seq.seq_id)
        self.policy.enqueue(seq, self.waiting)
        if scheduled is None or seq.seq_id not in scheduled:
            return 0
        allocations.pop(seq.seq_id)
        return scheduled.pop(seq.seq_id)

    def _build_output(self, scheduled: dict[str, int], allocations: dict[str, Allocation],
                      spec: dict[str, tuple[int, ...]]) -> SchedulerOutput:
        new, cached, forks, copies = [], [], [], []
        for seq_id, count in scheduled.items():
            seq, allocation = self.seqs[seq_id], allocations[seq_id]
            copies.extend(allocation.copies)
            trimmed = seq_id in self._trimmed
            self._trimmed.discard(seq_id)
            if seq_id in self._resend:
                self._resend.discard(seq_id)
                new.append(NewSequenceData(seq_id, tuple(seq.token_ids), seq.num_prompt_tokens,
                                           tuple(self.kv.block_table(seq_id)), seq.num_computed_tokens,
                                           seq.params, seq.seed))
            else:
                table = tuple(self.kv.block_table(seq_id)) if allocation.replaced or trimmed else None
                cached.append(CachedSequenceData(seq_id, seq.num_computed_tokens, allocation.new_blocks, table))
            if seq.fork_seeds and seq.num_computed_tokens + count == seq.num_tokens:
                forks.extend(ForkData(seq_id, f"{seq.request_id}#{i}", i, s)
                             for i, s in enumerate(seq.fork_seeds, start=1))
        dropped, self._dropped = frozenset(self._dropped), set()
        return SchedulerOutput(tuple(new), tuple(cached), scheduled, tuple(forks), tuple(copies), dropped, spec,
                               self.kv.take_tier_ops())

    def _loads_done(self, report: TierReport) -> None:
        """The step's tier copies are done: loading sequences go back to the queue (see the module doc)."""
        failed = self.kv.tiers.done(report) if self.kv.tiers is not None else set()
        for seq, first, count, status in self.loading.values():
            hashes = seq.block_hashes[first:first + count]
            loaded = next((i for i, h in enumerate(hashes) if h in failed), count)
            seq.num_computed_tokens = (first + loaded) * self.kv.block_size  # its blocks after the run: computed
            self.kv.cache_full_blocks(seq)
            if status is RequestStatus.WAITING:  # (a resumed one's cached outputs are not prompt tokens)
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                self.num_prompt_tokens_queried += seq.num_prompt_tokens
                self.num_prompt_tokens_cached += seq.num_cached_tokens
                self.num_prompt_tokens_from_tiers += seq.num_cached_tokens - min(first * self.kv.block_size,
                                                                                 seq.num_prompt_tokens)
            seq.status = status
            self.loaded.add(seq.seq_id)
            self.waiting.push(seq)  # back where it was (its wait goes on)
        self.loading.clear()

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[SeqUpdate]:
        """Applies a finished step: advances computed counts, caches newly full blocks, forks samples,
        appends sampled tokens and finishes sequences that hit a stop token or a length limit."""
        if self.loading or result.tiers.failed:
            self._loads_done(result.tiers)
        for seq_id, count in output.num_scheduled_tokens.items():
            seq = self.seqs.get(seq_id)
            if seq is None or seq.status is not RequestStatus.RUNNING:
                continue
            if proposed := output.spec_tokens.get(seq_id):  # the rejected proposals' KV is not the sequence's
                accepted = len(result.speculated.get(seq_id, ()))
                count -= len(proposed) - accepted
                self.speculator.verified(seq_id, len(proposed), accepted)
            seq.num_computed_tokens += count
            self.num_tokens_computed += count
            self.kv.cache_full_blocks(seq)
        for fork in output.forks:
            parent = self.seqs.get(fork.parent_id)
            if parent is None:
                continue
            child = parent.fork(fork.index, fork.child_id, fork.seed)
            self.kv.fork(parent, child)
            self.seqs[child.seq_id] = child
            self._by_request[child.request_id].append(child.seq_id)
            self.running.append(child)
            parent.fork_seeds = ()
        updates = []
        for seq_id, sampled in result.sampled.items():
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            for token in (sampled, *result.speculated.get(seq_id, ())):
                seq.append_token(token.token_id)
                status = token_stop_status(seq, self.eos_token_ids, self.config.max_model_len)
                if status is not None:
                    self.finish(seq, status)
                updates.append(SeqUpdate(seq, token, status))
                if status is not None:
                    break
            if seq_id in output.spec_tokens and seq.status is RequestStatus.RUNNING:
                if self.kv.trim(seq, seq.num_tokens):
                    self._trimmed.add(seq_id)
        return updates

    def stats(self) -> SchedulerStats:
        return collect_stats(self)

    def check_integrity(self) -> None:
        """Raises ValueError if KV ownership is inconsistent or a sequence is in the wrong place."""
        check_state(self)
