"""Builds the executor an engine's configuration asks for, and everything that sizes and speeds it up: the KV
cache's block count (from the memory left after the weights, shared with a draft model's KV), the attention
backend and its tuned kernels, the compiled decode step, the draft model, the KV transfer agent beside each
rank's cache, and the rank processes of a split replica (retrying a rendezvous port another process took)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

import torch

from tandem.engine.kv.tier_plan import TierPlan
from tandem.engine.decoding.draft_proposer import DraftProposer, load_draft
from tandem.engine.decoding.grammar import GrammarBackend
from tandem.engine.engine_config import EngineConfig, available_memory_bytes
from tandem.engine.errors import ReplicaFailedError
from tandem.engine.hardware.cpu_affinity import current_cpus
from tandem.engine.hardware.device import RankPlacement
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache, store_memory_of
from tandem.engine.kv.tier_store import TierStore
from tandem.engine.loader.model_loader import LoadedModel
from tandem.engine.models.compiled import BackgroundCompile, compile_decode, compile_mode, decode_step_summary
from tandem.engine.models.decode_bucket import blocks_per_sequence
from tandem.engine.models.lora import LoRASlots
from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout
from tandem.engine.runner.executor import Executor, LocalExecutor
from tandem.engine.runner.model_runner import ModelRunner

__all__ = ["Built", "ExecutorRequest", "KVAgentFactory", "build_executor"]

STARTUP_PORT_ATTEMPTS = 3
KVAgentFactory = Callable[[int, ReplicaLayout, PagedKVCache], Any]


@dataclass(frozen=True)
class Built:
    executor: Executor
    proposer: DraftProposer | None  # the speculative proposer the builder made (a draft model), or None


@dataclass(frozen=True)
class ExecutorRequest:
    """What build_executor needs: the model, the engine's settings, the split, the KV store's dtype, and where
    the ranks run (LLMEngine's arguments)."""

    loaded: LoadedModel
    config: EngineConfig
    layout: ReplicaLayout
    parallel: ParallelConfig
    kv_dtype: torch.dtype
    grammars: GrammarBackend  # the engine's: a one-process runner compiles with it too (its cache shared)
    kv_agent: KVAgentFactory | None = None
    rank_gpus: Seq[str] | None = None
    rank_cpus: Seq[tuple[int, ...]] | None = None
    tiers: TierPlan | None = None  # the replica's KV tiers (engine/core/kv_tiers.py), every rank's share

    def block_spec(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
        """One block of a cache of `layers` x `kv_heads` (num_blocks 1): what a block costs."""
        return KVCacheSpec(layers, 1, self.config.block_size, kv_heads, head_dim, dtype)

    def largest_share(self) -> KVCacheSpec:
        """One block of the largest rank share (its layers x its KV heads): it sets how many blocks fit."""
        shares = [self.layout.shard(r) for r in range(self.layout.world_size)]
        largest = max(shares, key=lambda s: len(s.layers) * len(s.kv_heads))
        return self.block_spec(len(largest.layers), len(largest.kv_heads), self.loaded.config.head_dim,
                               self.kv_dtype)

    def replica_spec(self, num_blocks: int) -> KVCacheSpec:
        """The whole replica's KV cache (every layer and KV head; each rank holds its share)."""
        c = self.loaded.config
        return KVCacheSpec(c.num_layers, num_blocks, self.config.block_size, c.num_kv_heads, c.head_dim,
                           self.kv_dtype)


def build_executor(request: ExecutorRequest) -> Built:
    """Raises ValueError for a KV budget that buys no block, a draft model on a split replica, a one-process
    engine without weights or a rank_cpus of the wrong length; ReplicaFailedError if a rank fails to start."""
    if request.layout.world_size == 1:
        return _one_process(request)
    return Built(_rank_processes(request), None)


def _one_process(request: ExecutorRequest) -> Built:
    from tandem.engine.attention.triton_backend import select_backend, tune_for

    loaded, config = request.loaded, request.config
    if loaded.model is None:
        raise ValueError("a single-process engine needs the model's weights (load_model(weights=True))")
    device = loaded.device
    loaded.model.attention = select_backend(config.attention_backend, device)
    if config.lora is not None:  # the adapters' pool is taken before the KV cache's share of memory is measured
        loaded.model.lora = LoRASlots(loaded.model, config.lora.max_loaded, config.lora.max_rank)
    draft = _draft(loaded, config)
    share = request.largest_share()
    bytes_per_block = share.bytes_per_block  # after the weights were loaded
    if draft is not None:  # a draft model's KV shares the budget
        c = draft.config
        bytes_per_block += request.block_spec(c.num_layers, c.num_kv_heads, c.head_dim, draft.dtype).bytes_per_block
    num_blocks = config.num_blocks(bytes_per_block, available_memory_bytes(device), device.type == "cuda")
    tune_for(loaded.model, config.block_size, kv_dtype=request.kv_dtype)  # frees what it takes before the cache
    kv_cache = PagedKVCache(request.replica_spec(num_blocks), device, store_memory_of(request.kv_agent, device))
    mode = compile_mode(config.compile)
    compiling = mode != "off"
    # In the background: the CPU's compiled step (a GPU captures its graphs before serving; a draft model's step
    # compiles with it, before its warm-up).
    background = mode == "background" and device.type == "cpu" and draft is None
    spec_tokens = config.speculative.max_tokens if config.speculative is not None else 0
    # Full CUDA graphs take block tables as wide as a sequence can need: max_model_len's blocks, at most the cache's.
    max_len = config.max_model_len or loaded.config.max_position_embeddings
    max_blocks = min(blocks_per_sequence(max_len, config.block_size), num_blocks)
    compiled = compile_decode(loaded.model, config.max_num_seqs, 1 + spec_tokens, kv_quantized=share.quantized,
                              kv_cache=kv_cache, max_blocks=max_blocks) if compiling and not background else None
    proposer = None
    if draft is not None:
        tune_for(draft.model, config.block_size)
        proposer = DraftProposer(draft.model, num_blocks, config.block_size)
        if compiling:  # the draft's first pass of a round computes the 1-2 tokens it lacks per sequence: compiled too
            proposer.compiled = compile_decode(draft.model, config.max_num_seqs, 1 + spec_tokens,
                                               kv_cache=proposer.kv_cache, max_blocks=max_blocks)
        proposer.warm_up(config.max_num_seqs)
    agent = request.kv_agent(0, request.layout, kv_cache) if request.kv_agent is not None else None
    # Structured output: the engine's backend refused a bad constraint at add_request, and its cache hands this
    # runner the compiled grammar (a split replica's sampler rank builds its own: ranks/worker.py).
    tiers = None
    if request.tiers is not None:
        tiers = TierStore(kv_cache, request.tiers.host_slots, request.tiers.rank_folder(0))
    runner = ModelRunner(loaded.model, kv_cache, compiled=compiled, layer_observer=agent, grammars=request.grammars,
                         tiers=tiers)
    if background:  # steps read runner.compiled each time: the first after the thread sets it runs compiled
        runner.background_compile = BackgroundCompile(
            lambda: compile_decode(loaded.model, config.max_num_seqs, 1 + spec_tokens),
            lambda step: setattr(runner, "compiled", step))
    placement = RankPlacement(0, os.getpid(), str(device), os.environ.get("CUDA_VISIBLE_DEVICES"),
                              loaded.model.attention.choice.summary(), current_cpus(),
                              decode_step_summary(loaded.model, compiling, compiled, background))
    return Built(LocalExecutor(runner, agent, placement), proposer)


def _draft(loaded: LoadedModel, config: EngineConfig) -> LoadedModel | None:
    """The draft model speculative decoding asks for (its attention backend set), or None."""
    spec = config.speculative
    if spec is None or spec.proposer != "draft":
        return None
    from tandem.engine.attention.triton_backend import select_backend

    draft = load_draft(loaded, spec.draft, loaded.device)
    draft.model.attention = select_backend(config.attention_backend, loaded.device)
    return draft


def _rank_processes(request: ExecutorRequest) -> Executor:
    """Each rank measures its device's free memory once its shard is loaded (this process never touches CUDA)
    and the smallest answer sizes every rank's cache; CPU ranks share this host, so they split it."""
    from tandem.engine.runner.ranks.executor import MultiprocExecutor, free_port
    from tandem.engine.runner.ranks.worker import WorkerSpec

    loaded, config, layout = request.loaded, request.config, request.layout
    if config.speculative is not None and config.speculative.proposer == "draft":
        raise ValueError("a draft model runs in the engine's process, beside a model in one process; a "
                         "replica split over ranks speculates with the ngram or suffix proposer")
    if request.rank_cpus is not None and len(request.rank_cpus) != layout.world_size:
        raise ValueError(f"rank_cpus lists {len(request.rank_cpus)} CPU sets for {layout.world_size} ranks")
    on_gpu = loaded.device.type == "cuda"
    share = 1 if on_gpu else layout.world_size
    bytes_per_block = request.largest_share().bytes_per_block
    threads = max(1, torch.get_num_threads() // layout.world_size)

    def start() -> Executor:
        return MultiprocExecutor(WorkerSpec(
            model_path=str(loaded.source), dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.device), layout=layout, block_size=config.block_size,
            max_positions=loaded.config.max_position_embeddings,
            init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=request.parallel.collective_timeout_s,
            threads=threads, micro_batches=request.parallel.num_micro_batches, kv_agent=request.kv_agent,
            attention_backend=config.attention_backend, visible_gpus=request.rank_gpus,
            cpus=None if request.rank_cpus is None else tuple(tuple(c) for c in request.rank_cpus),
            weight_format=loaded.weight_format, kv_dtype=config.kv_cache_dtype, load_format=loaded.load_format,
            kv_tiers=request.tiers, lora=config.lora),
            kv_blocks=lambda free: config.num_blocks(bytes_per_block, free // share, on_gpu))

    for _ in range(STARTUP_PORT_ATTEMPTS - 1):
        # free_port() may be taken by another process before rank 0 binds it: then try another port.
        try:
            return start()
        except ReplicaFailedError as e:
            if "EADDRINUSE" not in str(e):
                raise
    return start()
