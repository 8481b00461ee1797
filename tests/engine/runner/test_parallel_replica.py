"""One replica across processes (gloo on loopback): tp, pp, ep and their products give the same greedy tokens
as one process through continuous batching, each rank holds only its share of the KV cache, and a rank that
dies fails the replica fast instead of hanging it."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time

import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.errors import ReplicaFailedError
from tandem.engine.loader import load_model
from tandem.engine.parallel import ParallelConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler_output import CachedSequenceData, SchedulerOutput
from tests.engine.probe_agent import ProbeAgent
from tests.engine.tiny_models import write_tiny_model
from tests.reference import hf_greedy

TEXTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, there was a little robot who",
         "1, 2, 3, 4,", "Water boils at"]
MAX_TOKENS = 10
CONFIG = EngineConfig(num_kv_blocks=48, max_num_batched_tokens=24)  # prompts arrive mid-run and prefill in chunks


def label(value) -> str:
    if not isinstance(value, ParallelConfig):
        return str(value)
    extra = "-staged" if value.stage_layers else "-mapped" if value.expert_ranks else ""
    return f"tp{value.tp}-pp{value.pp}-ep{value.ep}{extra}"


def run_staggered(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Adds prompt i at step 2 * i, so decodes, prefill chunks and arrivals share steps; greedy."""
    outputs: dict[str, list[int]] = {}
    step = 0
    while step < 2 * len(prompts) or engine.has_unfinished_requests():
        if step % 2 == 0 and step // 2 < len(prompts):
            engine.add_request(str(step // 2), prompts[step // 2],
                               SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    assert engine.stats().num_blocks_in_use == 0
    return outputs


def check_kv_shares(engine: LLMEngine) -> None:
    """Every rank's KV store holds exactly its layers x its KV heads, for the replica's block count."""
    spec, layout = engine.kv_cache_spec, engine.layout
    per_layer_head = spec.bytes_per_block // (spec.num_layers * spec.num_kv_heads) * spec.num_blocks
    whole = per_layer_head * spec.num_layers * spec.num_kv_heads
    stats = engine.executor.rank_stats()
    for rank_stats in stats:
        shard = layout.shard(rank_stats.rank)
        assert rank_stats.kv_cache_bytes == per_layer_head * len(shard.layers) * len(shard.kv_heads)
        assert rank_stats.kv_cache_bytes < whole or layout.tp == layout.pp == 1
    if layout.ep == 1 and layout.tp <= spec.num_kv_heads:  # no KV head stored twice: the shares add up
        assert sum(s.kv_cache_bytes for s in stats) == whole
    return stats


@pytest.fixture(scope="module")
def embedded_prompts(embedded):
    return [embedded.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def embedded_reference(embedded, embedded_prompts):
    return run_staggered(LLMEngine(embedded, CONFIG), embedded_prompts)


# tp=3 (9 query and 3 KV heads split three ways), tp=2 x pp=2 and an uneven pp=2 with micro-batches in `make test`;
# plain tp=2, pp=2 and pp=3 repeat what those show and are the slow variants.
@pytest.mark.parametrize("parallel", [
    pytest.param(ParallelConfig(tp=2), marks=pytest.mark.slow), ParallelConfig(tp=3),
    pytest.param(ParallelConfig(pp=2), marks=pytest.mark.slow),
    pytest.param(ParallelConfig(pp=3), marks=pytest.mark.slow),
    ParallelConfig(tp=2, pp=2), ParallelConfig(pp=2, stage_layers=(21, 9), micro_batches=3)], ids=label)
def test_embedded_model_split_gives_one_process_tokens(parallel, embedded_prompts, embedded_reference):
    meta = load_model(weights=False, progress=False)
    with LLMEngine(meta, CONFIG, parallel=parallel) as engine:
        assert run_staggered(engine, embedded_prompts) == embedded_reference
        stats = check_kv_shares(engine)
        if parallel.pp > 1:  # later stages wait for earlier ones: the pipeline is measured, not assumed
            assert all(s.comm_s.get("pp_wait", 0) > 0 for s in stats if s.rank >= parallel.tp)


@pytest.fixture(scope="module")
def moe_models(embedded, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    models = {}
    for kind in ("mixtral", "qwen2_moe", "qwen3_moe"):
        folder = write_tiny_model(tmp_path_factory.mktemp(kind), kind, embedded.tokenizer)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        prompts = [embedded.tokenizer.encode(t) for t in TEXTS]
        reference = run_staggered(LLMEngine(load_model(folder, progress=False), CONFIG), prompts)
        expected = {str(i): hf_greedy(hf, p, MAX_TOKENS)[0] for i, p in enumerate(prompts)}
        assert reference == expected, f"{kind}: one process must already match transformers"
        models[kind] = (folder, prompts, reference)
    return models


@pytest.mark.parametrize("kind,parallel", [
    ("mixtral", ParallelConfig(ep=2)), ("mixtral", ParallelConfig(ep=4)), ("mixtral", ParallelConfig(ep=2, pp=2)),
    ("mixtral", ParallelConfig(ep=2, tp=2)), ("qwen2_moe", ParallelConfig(ep=2)),
    ("qwen2_moe", ParallelConfig(ep=2, tp=2)),
    ("qwen2_moe", ParallelConfig(ep=2, expert_ranks=(1, 0, 0, 1, 1, 0, 0, 1))),  # an explicit placement
    ("qwen3_moe", ParallelConfig(ep=2, tp=2)),  # per-head query/key norms on split heads
], ids=label)
def test_moe_split_gives_one_process_and_transformers_tokens(kind, parallel, moe_models):
    folder, prompts, reference = moe_models[kind]
    meta = load_model(folder, weights=False, progress=False)
    with LLMEngine(meta, CONFIG, parallel=parallel) as engine:
        assert run_staggered(engine, prompts) == reference
        stats = check_kv_shares(engine)
        layout, moe = engine.layout, meta.config.moe
        computed = engine.stats().num_tokens_computed
        for stage, layers in enumerate(layout.stage_layers):
            sparse = sum(moe.sparse_layers[n] for n in layers)
            ranks = layout.ep_group(stage, 0)
            for rank in ranks:  # each rank computed only its own experts...
                assert set(stats[rank].expert_load) <= set(layout.shard(rank).experts)
            # ...and together they computed every (token, k) pair of the stage's MoE layers exactly once.
            assert sum(sum(stats[r].expert_load.values()) for r in ranks) == computed * moe.top_k * sparse


def test_kv_agents_answer_in_each_rank_process_and_a_killed_rank_fails_the_replica_fast(embedded_prompts):
    """One tp=2 replica (ranks are slow to start) for two checks: call_kv_agents runs a callable on each rank's
    agent in that rank's process; then a killed rank fails the replica fast, naming the rank."""
    meta = load_model(weights=False, progress=False)
    # rank_gpus: what a replica actor hands its ranks from the GPU IDs Ray gave it (only bookkeeping on the CPU)
    engine = LLMEngine(meta, CONFIG, parallel=ParallelConfig(tp=2, collective_timeout_s=30), kv_agent=ProbeAgent,
                       rank_gpus=("7", "5"))
    try:
        where = engine.call_kv_agents(ProbeAgent.where, {0: ("first",), 1: ("second",)})
        shapes = [s.kv_cache_shape for s in engine.executor.rank_stats()]
        assert [(rank, shape, tag) for rank, _, shape, tag in (where[0], where[1])] == [
            (0, shapes[0], "first"), (1, shapes[1], "second")]
        assert len({where[0][1], where[1][1], os.getpid()}) == 3, "each agent lives in its own rank's process"
        # each rank reports, from its own process, the GPU it was told to see; the KV size every rank agreed on
        assert [(p.rank, p.pid, p.device, p.visible_gpus, p.attention) for p in engine.rank_placements] == [
            (0, where[0][1], "cpu", "7", "torch (cpu device)"), (1, where[1][1], "cpu", "5", "torch (cpu device)")]
        assert [shape[2] for shape in shapes] == [CONFIG.num_kv_blocks] * 2 == [engine.kv_cache_spec.num_blocks] * 2
        with pytest.raises(LookupError, match="rank 1 refuses"):  # the agent's error, not a failed replica
            engine.call_kv_agents(ProbeAgent.refuse, {1: ()})

        def local(agent):
            return agent.rank

        with pytest.raises((pickle.PicklingError, AttributeError)):  # refused before any rank is asked
            engine.call_kv_agents(local, {0: (), 1: ()})
        assert engine.call_kv_agents(ProbeAgent.where, {1: ("again",)})[1][3] == "again", "the ranks live on"

        engine.add_request("a", embedded_prompts[0], SamplingParams(max_tokens=50, temperature=0))
        engine.step()
        assert engine.dead_ranks() == []
        engine.executor.kill_rank(1)
        deadline = time.monotonic() + 5
        while not engine.dead_ranks() and time.monotonic() < deadline:  # seen before any step runs (heartbeat)
            time.sleep(0.01)
        assert len(engine.dead_ranks()) == 1 and engine.dead_ranks()[0].startswith("rank 1 (stage 0, ep 0, tp 1)")
        start = time.monotonic()
        with pytest.raises(ReplicaFailedError, match=r"rank 1 \(stage 0, ep 0, tp 1\)"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 10, "a dead rank must not wait out the collective timeout"
        assert not any(p.is_alive() for p in engine.executor._procs), "the surviving ranks must be stopped"
        assert engine.dead_ranks() == [], "ranks stopped on purpose are not reported dead"
        with pytest.raises(ReplicaFailedError, match="shut down"):
            engine.step()
    finally:
        engine.shutdown()


def test_an_error_on_a_rank_reaches_the_driver_with_its_traceback(embedded_prompts):
    meta = load_model(weights=False, progress=False)
    with LLMEngine(meta, CONFIG, parallel=ParallelConfig(pp=2)) as engine:
        bogus = SchedulerOutput(cached_seqs=(CachedSequenceData("never-sent", 0, (), None),),
                                num_scheduled_tokens={"never-sent": 1})
        with pytest.raises(ReplicaFailedError, match="KeyError: 'never-sent'"):
            engine.executor.execute_step(bogus)


def test_async_engine_streams_from_a_split_replica_and_ends_streams_when_a_rank_dies(embedded_prompts,
                                                                                      embedded_reference):
    import asyncio

    from tandem.engine.core.async_engine import AsyncEngine, EngineDeadError

    meta = load_model(weights=False, progress=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLMEngine(meta, CONFIG, parallel=ParallelConfig(pp=2)) as engine:

        async def main():
            async with AsyncEngine(engine) as server:
                streamed = [t async for o in server.generate("a", embedded_prompts[0], params) for t in o.token_ids]
                long = server.generate("b", embedded_prompts[1], SamplingParams(max_tokens=500, ignore_eos=True))
                await anext(long)
                engine.executor.kill_rank(0)
                with pytest.raises(EngineDeadError, match="rank 0"):
                    async for _ in long:
                        pass
                return streamed

        assert asyncio.run(main()) == embedded_reference["0"]


def test_a_kv_budget_the_ranks_memory_cannot_buy_stops_the_ranks_with_a_clear_error(tiny_llama):
    meta = load_model(tiny_llama.source, weights=False, progress=False)
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(meta, EngineConfig(kv_cache_bytes=1), parallel=ParallelConfig(pp=2))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tandem-rank-")]
