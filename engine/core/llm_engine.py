"""One engine replica in one process: the scheduler, the model runner and the output processor, stepped.

A step: the scheduler picks the batch (scheduler.py), the runner computes and samples it, the scheduler applies
the result (tokens, stop tokens, lengths, caching), the output processor turns tokens into text deltas and
catches stop strings. add_request validates at once and raises before anything is queued; abort_request frees
the request's blocks immediately. This class is synchronous; engine/core/async_engine.py runs it on a thread.

The model runs behind an Executor (engine/runner/executor.py, built by engine/runner/builder.py): in this
process, or with a ParallelConfig of more than one rank in separate processes (engine/runner/ranks/, split as
engine/parallel/layout.py says) while the scheduler stays here.
Every rank's KV cache has the same number of blocks (block ids are global), each holding only that rank's layers
and KV heads. Call shutdown() (or use the engine as a context manager) to stop the ranks.

KV transfer (kv_transfer/, a layer above) plugs in through `kv_agent`: a picklable factory
`(rank, layout, kv_cache) -> agent` called beside every rank's KV store (in the rank's process); a factory with
a store_memory(device) method says where each rank's CPU KV store lives (store_memory_of).
hold_blocks_after(request_id, key) keeps a request's blocks allocated after it ends or is preempted, until
release_held_blocks(key): a prefill replica whose same-host peers read KV straight from its store needs
them to outlive the request until the peer has read them. The runner calls
the agent's on_layers_done(layer, tables) after each layer of a step that completes prompts, and
call_kv_agents(fn, args_by_rank) runs fn(agent, *args) beside each named rank's agent (fn: a picklable callable
such as an unbound agent method, never a method name). reserve_for_transfer() and admit_transferred() are the
decode side's way in: blocks held for a prompt whose KV another replica computes, then the request continued
from its first token. add_request(..., resume=ResumeState) continues a request another replica started (the
router's migration after a replica died; engine/core/resume.py).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence as Seq, TypeVar

from tandem.engine.core.kv_cache_manager import KVCacheManager
from tandem.engine.core.kv_tiers import KVTiers, TierHitCosts, hit_costs
from tandem.engine.core.lora_registry import LoRARegistry
from tandem.engine.kv.tier_plan import plan_tiers
from tandem.engine.core.output_processor import OutputProcessor, RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from tandem.engine.decoding.grammar import GrammarBackend
from tandem.engine.decoding.speculation import SpeculationStats, Speculator
from tandem.engine.engine_config import EngineConfig
from tandem.engine.errors import RequestRejectedError
from tandem.engine.hardware.device import RankPlacement
from tandem.engine.kv.kv_cache import kv_storage_dtype
from tandem.engine.kv.kv_events import DISK, HOST, KVEventSink, discard_events
from tandem.engine.loader.model_loader import LoadedModel
from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout
from tandem.engine.request import RequestStatus, Sequence, token_stop_status
from tandem.engine.runner.builder import ExecutorRequest, KVAgentFactory, build_executor
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams

__all__ = ["EngineStats", "KVAgentFactory", "LLMEngine", "RequestRejectedError"]

T = TypeVar("T")


@dataclass(frozen=True)
class EngineStats(SchedulerStats):
    num_steps: int = 0
    prefill_tokens: int = 0  # tokens computed by the steps that computed prompt tokens, and those steps' seconds
    prefill_s: float = 0.0
    tier_hit_costs: TierHitCosts | None = None  # None: no KV tiers

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The replica's measured prefill speed; None before it has prefilled."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else None


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), *,
                 event_sink: KVEventSink = discard_events, parallel: ParallelConfig = ParallelConfig(),
                 kv_agent: KVAgentFactory | None = None, rank_gpus: Seq[str] | None = None,
                 rank_cpus: Seq[tuple[int, ...]] | None = None):
        """loaded.model may be None (weights=False) when parallel spans more than one rank. rank_gpus: each
        rank's CUDA_VISIBLE_DEVICES (None: the ranks inherit this process's and rank r takes cuda:r). rank_cpus:
        each rank's host CPUs, in rank order, which its process pins itself to (None: the ranks inherit this
        process's). Like rank_gpus it is ignored for one rank, which computes in this process: its owner pins
        that (replica/spec.py). Raises ValueError for a split the model cannot take, a KV budget that buys no block
        or a rank_cpus of the wrong length, ReplicaFailedError if a rank fails to start (also for CPUs the host
        does not offer)."""
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        model_config = loaded.config
        max_len = config.max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's context "
                             f"({model_config.max_position_embeddings})")
        self.layout = ReplicaLayout.build(parallel, num_layers=model_config.num_layers,
                                          num_heads=model_config.num_heads, num_kv_heads=model_config.num_kv_heads,
                                          num_experts=model_config.num_experts)
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, loaded.dtype)
        self.vocab_size = model_config.vocab_size
        self.grammars = GrammarBackend(self.tokenizer, self.vocab_size)  # refuses a bad constraint at add_request
        request = ExecutorRequest(loaded, config, self.layout, parallel, self.kv_dtype, self.grammars, kv_agent,
                                  rank_gpus, rank_cpus)
        self.tier_plan = None
        if (tiers := config.kv_tiers) is not None:
            self.tier_plan = plan_tiers(tiers.host_bytes, tiers.disk_path, tiers.disk_bytes,
                                        request.replica_spec(1).bytes_per_block, self.layout.world_size)
            request = dataclasses.replace(request, tiers=self.tier_plan)
        try:
            built = build_executor(request)
        except BaseException:
            self._remove_tier_folder()
            raise
        self.executor = built.executor
        self.kv_cache_spec = request.replica_spec(self.executor.num_kv_blocks)
        self.has_kv_agents = kv_agent is not None
        self.kv_manager = KVCacheManager(
            self.executor.num_kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            event_sink=event_sink,
            tiers=KVTiers(self.tier_plan.host_slots, self.tier_plan.disk_slots, event_sink,
                          block_bytes=self.kv_cache_spec.bytes_per_block) if self.tier_plan else None)
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=max_len, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs, enable_chunked_prefill=config.enable_chunked_prefill,
                            max_loras=config.lora.max_loaded if config.lora is not None else 0,
                            scheduling=config.scheduling),
            self.kv_manager, frozenset(self.tokenizer.eos_token_ids),
            Speculator(config.speculative, built.proposer) if config.speculative is not None else None)
        self.outputs = OutputProcessor(self.tokenizer)
        self.lora = LoRARegistry(config.lora, model_config)  # the LoRA adapters served (load_lora)
        self.num_steps = 0
        self.prefill_tokens, self.prefill_s = 0, 0.0
        self._arrivals = 0

    @property
    def rank_placements(self) -> tuple[RankPlacement, ...]:
        """Where each rank runs (its process, device, CPUs, attention kernels and decode step), in rank order."""
        return self.executor.placements

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams, resume: ResumeState | None = None) -> None:
        """Raises ValueError / RequestRejectedError with a message for a request that cannot be served (resume:
        see add_request). Pure: usable from another thread before queueing the request."""
        if resume is not None:
            resume.check(params, self.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if (bad := next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)) is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        params.check_vocab(self.vocab_size)
        self.lora.check(params)  # UnknownAdapterError (a ValueError) for an adapter not loaded
        if params.structured is not None:  # raises InvalidStructuredOutput (a ValueError) with the compiler's message
            grammar = self.grammars.compile(params.structured)
            if resume is not None:  # the delivered tokens must fit the grammar they were sampled under
                grammar.matcher(resume.output_token_ids)
        # Before any per-sample work (the seeds below): n is the client's number.
        self.scheduler.check_admissible(len(prompt_token_ids), params.max_tokens, params.n)

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None, resume: ResumeState | None = None,
                    tenant: str | None = None) -> None:
        """Queues a request (tenant: who sent it, whose share it takes under the fair policy). Raises ValueError
        (bad input, duplicate id) or RequestRejectedError (can never fit); nothing is queued then. A request
        without a seed gets a random one, so its output still does not depend on the batch it lands in or on
        preemption.

        resume: the request continues a run another replica started (a migrated request, engine/core/resume.py):
        its sequence starts with resume.output_token_ids as outputs (prefilled with the prompt; they count for
        max_tokens and penalties, and the sampler's step continues after them), draws with resume.seed, and its
        outputs start with the token after them, the text delta included (the output processor is primed);
        num_prompt_tokens stays the prompt's. Raises ValueError also for n > 1 and for delivered tokens that
        already end the request (max_tokens, a stop token or stop string)."""
        seq = self._sequence(request_id, prompt_token_ids, params, priority, cache_salt, resume, tenant)
        primed = {seq.seq_id: self.outputs.primed(seq)} if resume is not None else None
        self.scheduler.add(seq)
        self._arrivals += 1
        self.outputs.add_request(request_id, params.n, primed=primed)

    def _sequence(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, priority: int,
                  cache_salt: str | None, resume: ResumeState | None = None, tenant: str | None = None) -> Sequence:
        self.validate(prompt_token_ids, params, resume)
        if resume is not None and resume.seed is not None:
            seeds = [resume.seed]  # n == 1 (validated)
        elif params.seed is not None:
            seeds = [params.seed + i for i in range(params.n)]
        else:
            seeds = [secrets.randbits(63) for _ in range(params.n)]
        seq = Sequence(f"{request_id}#0", request_id, 0, tuple(int(t) for t in prompt_token_ids), params,
                       seeds[0], priority, self._arrivals, cache_salt, self.config.block_size,
                       fork_seeds=tuple(seeds[1:]), tenant=tenant)
        if resume is not None and resume.output_token_ids:
            seq.resume(resume.output_token_ids)
            if token_stop_status(seq, self.scheduler.eos_token_ids, self.max_model_len) is not None:
                raise ValueError("the delivered tokens already end the request (a stop token or the context "
                                 "length): there is nothing to resume")
        return seq

    def reserve_for_transfer(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                             priority: int = 0, cache_salt: str | None = None,
                             tenant: str | None = None, waited_s: float = 0.0) -> tuple[int, ...] | None:
        """Holds KV blocks for the prompt of a request whose prompt KV another replica computes (decode side of
        disaggregation). Returns the block ids (the same on every rank, in token order), or None when there is
        no room now (nothing is held; retry later or on another replica). The request then waits, never
        scheduled, until admit_transferred() or abort_request(). Raises like add_request, and ValueError for
        n > 1. params.seed must be the one the prefill replica sampled the first token with for the output to
        match a colocated run. waited_s: how long the request has already waited for room (elsewhere: the
        router's decode room); past scheduler.preempt_after_s it may preempt running requests of lower priority
        (Scheduler.reserve)."""
        blocks = self.scheduler.reserve(self._sequence(request_id, prompt_token_ids, params, priority, cache_salt,
                                                       tenant=tenant), waited_s=waited_s)
        if blocks is not None:
            self._arrivals += 1
            self.outputs.add_request(request_id, params.n)
        return blocks

    def admit_transferred(self, request_id: str, first: SampledToken) -> list[RequestOutput]:
        """Continues a reserved request whose prompt KV has fully arrived, with `first` (the token the prefill
        replica drew) as its first output token. Returns that token's output (the request may finish on
        it). Raises KeyError if the request holds no reservation."""
        update = self.scheduler.admit_transferred(request_id, first)
        output, hit_stop_string = self.outputs.process(update)
        if hit_stop_string and update.status is None:
            self.scheduler.finish(update.seq, RequestStatus.FINISHED_STOPPED)
        return [output]

    def reserve_prefix(self, request_id: str, prefix_token_ids: Seq[int], *,
                       cache_salt: str | None = None) -> tuple[int, ...] | None:
        """Holds KV blocks for a prefix (whole blocks of tokens) another replica sends (a pull): the prefix
        cache's own blocks of it, and new ones for the rest, which are returned (in token order; the transfer
        fills them). None when there is no room now (nothing held). keep_transferred_prefix() or abort_request()
        ends it. Raises ValueError for a prefix that is not whole blocks."""
        if not prefix_token_ids or len(prefix_token_ids) % self.config.block_size:
            raise ValueError(f"a pulled prefix is whole blocks of {self.config.block_size} tokens, "
                             f"not {len(prefix_token_ids)}")
        seq = self._sequence(request_id, prefix_token_ids, SamplingParams(max_tokens=1), 0, cache_salt)
        blocks = self.scheduler.reserve(seq, cached=True)
        if blocks is None:
            return None
        self.outputs.add_request(request_id, 1)
        return blocks[sum(self.scheduler.kv.cache.is_cached(b) for b in blocks):]  # (the cached ones come first)

    def keep_transferred_prefix(self, request_id: str) -> int:
        """Ends a reserved request whose KV has fully arrived and is only a prefix to keep (pulled from another
        replica, kv_transfer/prefix_pull.py): its full blocks enter the prefix cache, parked. Returns how many
        blocks. Raises KeyError if the request holds no reservation."""
        seq = next((s for s in self.scheduler.reserved.values() if s.request_id == request_id), None)
        if seq is None:
            raise KeyError(f"request {request_id!r} holds no KV reservation")
        blocks = len(self.scheduler.kv.block_table(seq.seq_id))
        self.scheduler.admit_transferred(request_id, None)
        self.outputs.aborted([seq])
        return blocks

    def cached_run(self, block_hashes: Seq[int]) -> int:
        """How many of block_hashes, from the first, the prefix cache holds on the device now."""
        return len(self.scheduler.kv.cache.match(list(block_hashes)).blocks)

    def hold_cached_prefix(self, key: str, block_hashes: Seq[int]) -> tuple[int, ...]:
        """Holds the blocks of the prefix cache's longest run of block_hashes under key (they stay allocated,
        unevicted, until release_held_blocks(key)) and returns them, in order (possibly fewer than asked: the
        rest is not cached here any more; none: nothing held)."""
        return self.scheduler.kv.hold_cached(key, block_hashes)

    def call_kv_agents(self, fn: Callable[..., T], args_by_rank: Mapping[int, tuple]) -> dict[int, T]:
        """Runs fn(agent, *args) on the KV transfer agent of each rank in args_by_rank, in that rank's process;
        returns the results by rank. fn and args must pickle when the ranks are separate processes (a
        module-level function or an unbound method such as KVTransferAgent.expect). An exception fn raises is
        raised here. Raises ValueError if the engine was built without kv_agent, and ReplicaFailedError if a
        rank fails."""
        if not self.has_kv_agents:
            raise ValueError("this engine was built without a KV transfer agent (LLMEngine(kv_agent=...))")
        return self.executor.call_agents(fn, args_by_rank)

    def hold_blocks_after(self, request_id: str, key: str) -> None:
        """From now on, blocks the request frees (when it ends, is aborted or preempted) stay allocated, held
        under key, until release_held_blocks(key)."""
        self.scheduler.hold_after[request_id] = key

    def release_held_blocks(self, key: str) -> int:
        """Stops holding under key and frees the blocks held (as the request's end would have). Returns how many
        holds ended."""
        for request_id in [r for r, k in self.scheduler.hold_after.items() if k == key]:
            del self.scheduler.hold_after[request_id]
        return self.scheduler.kv.release(key)

    def load_lora(self, name: str, path: str) -> float:
        """Serves the PEFT adapter at `path` as `name` (core/lora_registry.py: a name stays bound to its folder);
        returns the seconds its check took. Raises ValueError (LoRAAdapterError for the adapter's files)."""
        return self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Stops serving adapter `name`. Raises UnknownAdapterError if it is not loaded, ValueError while requests
        use it."""
        if users := sum(seq.params.lora == name for seq in self.scheduler.seqs.values()):
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        self.lora.unload(name)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Ends a request now, freeing its blocks; returns its final outputs (empty for an unknown or finished id)."""
        return self.outputs.aborted(self.scheduler.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_schedulable_requests(self) -> bool:
        """Whether step() has work: requests waiting or running (not those parked until their KV arrives)."""
        return self.scheduler.has_schedulable()

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step and returns the outputs it produced (possibly none, e.g. mid-prefill): one per
        sample that got tokens (a speculating sample may get several in one output)."""
        start = time.perf_counter()
        schedule = self.scheduler.schedule()
        for new in schedule.new_seqs:  # when each sequence was first scheduled (for request traces)
            if (seq := self.scheduler.seqs.get(new.seq_id)) is not None and seq.scheduled_at is None:
                seq.scheduled_at = time.monotonic()
        if changes := self.lora.take_changes():
            schedule = dataclasses.replace(schedule, lora_changes=changes)
        executed = time.perf_counter()
        version = self.executor.step_version()  # before the step: the runner reads its step as it starts
        result = self.executor.execute_step(schedule)
        if any(n > 1 + len(schedule.spec_tokens.get(i, ())) for i, n in schedule.num_scheduled_tokens.items()):
            self.prefill_tokens += schedule.total_num_scheduled_tokens  # a step that prefills: its speed
            self.prefill_s += time.perf_counter() - executed
        updates = self.scheduler.update(schedule, result)
        outputs: dict[str, RequestOutput] = {}
        emitted = len(updates)
        for update in updates:
            seq_id = update.seq.seq_id
            if seq_id in outputs and outputs[seq_id].finish_reason is not None:
                continue  # its text hit a stop string on an earlier token of this step
            output, hit_stop_string = self.outputs.process(update)
            if hit_stop_string and update.status is None:
                self.scheduler.finish(update.seq, RequestStatus.FINISHED_STOPPED)
            outputs[seq_id] = output if seq_id not in outputs else outputs[seq_id].followed_by(output)
        if not schedule.is_empty:
            self.num_steps += 1
            speculator = self.scheduler.speculator
            if speculator is not None:
                speculator.step_is(version)
                if not schedule.forks and all(n == 1 + len(schedule.spec_tokens.get(i, ()))
                                              for i, n in schedule.num_scheduled_tokens.items()):
                    speculator.step_timed(len(schedule.num_scheduled_tokens), schedule.total_num_scheduled_tokens,
                                          emitted, time.perf_counter() - start, bool(schedule.spec_tokens))
        if self.config.check_integrity:
            self.scheduler.check_integrity()
        return list(outputs.values())

    def speculation_stats(self) -> SpeculationStats | None:
        """What speculative decoding proposed and got accepted here; None when the engine does not speculate."""
        speculator = self.scheduler.speculator
        return speculator.stats() if speculator is not None else None

    def stats(self) -> EngineStats:
        stats = EngineStats(**vars(self.scheduler.stats()), num_steps=self.num_steps,
                            prefill_tokens=self.prefill_tokens, prefill_s=self.prefill_s)
        if stats.tiers is None:
            return stats
        return dataclasses.replace(stats, tier_hit_costs=hit_costs(stats.tiers, stats.prefill_tokens_per_s,
                                                                     self.config.block_size))

    def cached_block_hashes(self, tier: str = "device") -> tuple[int, ...]:
        """The hashes of every block on `tier` now: the prefix cache ("device"), or the KV tiers' "host" or
        "disk" (empty without them). Engine thread only."""
        if tier in (HOST, DISK):
            tiers = self.scheduler.kv.tiers
            return tiers.hashes(tier) if tiers is not None else ()
        return self.scheduler.kv.cache.hashes()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def dead_ranks(self) -> list[str]:
        """The rank processes of a multi-process replica that have exited, described (safe from any thread)."""
        return self.executor.dead_ranks()

    def ranks_alive(self) -> list[bool]:
        """Whether each rank's process runs (one rank in this process: it does). Safe from any thread."""
        return self.executor.ranks_alive()

    def shutdown(self) -> None:
        """Stops the ranks of a multi-process replica, or this process's KV transfer agent, and removes the disk
        tier's folder. Idempotent."""
        try:
            self.executor.shutdown()
        finally:
            self._remove_tier_folder()

    def _remove_tier_folder(self) -> None:
        if self.tier_plan is not None and self.tier_plan.disk_folder is not None:
            shutil.rmtree(self.tier_plan.disk_folder, ignore_errors=True)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
