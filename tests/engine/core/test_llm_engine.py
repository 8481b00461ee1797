"""The engine on the embedded model: batching, prefix caching, chunking and preemption never change the tokens."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

from tandem.engine.core.llm_engine import LLMEngine, RequestRejectedError
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv.kv_events import BlockStored, KVEventRecorder
from tandem.engine.sampling_params import SamplingParams

from tests.engine.engine_helpers import Completion, collect, run_all
from tests.engine.probe_agent import ProbeAgent

TEXTS = [
    "Once upon a time", "The capital of France is", "def fibonacci(n):", "Water boils at",
    "List three colors:", "In 1969, the first", "The quick brown fox", "import numpy as np\n",
    "Q: What is 2+2?\nA:", "Dear Sir or Madam,", "The mitochondria is", "To make bread, you need",
]
SYSTEM = ("You are a careful assistant. Answer briefly and truthfully. If you do not know, say so. "
          "Always use metric units and cite the year when a fact may have changed. ")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def engine_for(loaded, **config) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**({"num_kv_blocks": 192, "max_model_len": 1024} | config)))


def alone(loaded, prompt_ids, params) -> list[int]:
    engine = engine_for(loaded, enable_prefix_caching=False)
    engine.add_request("alone", prompt_ids, params)
    return run_all(engine)[("alone", 0)].token_ids


@pytest.fixture(scope="module")
def requests(embedded):
    tok = embedded.tokenizer
    out = []
    for i in range(16):
        text = TEXTS[i % len(TEXTS)]
        ids = tok.encode(SYSTEM + text) if i % 3 == 0 else tok.encode(text * (1 + i % 4))
        out.append((f"r{i}", ids, 4 + (i * 5) % 17))
    return out


def test_sixteen_requests_batched_equal_each_run_alone(embedded, requests):
    engine = engine_for(embedded, max_num_batched_tokens=48, check_integrity=True)
    arrivals = {rid: i // 4 * 3 for i, (rid, _, _) in enumerate(requests)}  # four join every third step
    done = defaultdict(Completion)
    step = 0
    while step <= max(arrivals.values()) or engine.has_unfinished_requests():
        for rid, ids, n in requests:
            if arrivals[rid] == step:
                engine.add_request(rid, ids, greedy(n))
        collect(engine.step(), done)
        step += 1
    stats = engine.stats()
    assert stats.num_prompt_tokens_cached > 0  # the shared system prompt was reused
    assert stats.num_blocks_in_use == 0
    for rid, ids, n in requests:
        assert done[(rid, 0)].token_ids == alone(embedded, ids, greedy(n)), rid


def test_shared_prefix_is_computed_once_and_changes_nothing(embedded):
    tok = embedded.tokenizer
    prefix = tok.encode(SYSTEM * 8)[:200]
    assert len(prefix) == 200
    first, second = prefix + tok.encode(" Tell me about rivers."), prefix + tok.encode(" Name a planet.")
    events = KVEventRecorder()
    engine = LLMEngine(embedded, EngineConfig(num_kv_blocks=192, max_model_len=1024), event_sink=events)
    engine.add_request("first", first, greedy(6))
    run_all(engine)
    before = engine.stats().num_tokens_computed
    engine.add_request("second", second, greedy(6))
    result = run_all(engine)[("second", 0)]
    cached = 200 // 16 * 16
    assert result.num_cached_tokens == cached
    assert engine.stats().num_tokens_computed - before == len(second) - cached + 5  # + 5 decode steps
    assert result.token_ids == alone(embedded, second, greedy(6))
    assert sum(isinstance(e, BlockStored) for e in events.events) >= 200 // 16

    before = engine.stats().num_tokens_computed
    engine.add_request("other-tenant", second, greedy(6), cache_salt="tenant-b")
    salted = run_all(engine)[("other-tenant", 0)]
    assert salted.num_cached_tokens == 0
    assert engine.stats().num_tokens_computed - before == len(second) + 5
    assert salted.token_ids == result.token_ids


def test_chunked_prefill_and_preemption_do_not_change_tokens(embedded, requests):
    chosen = requests[:6]
    reference = {rid: alone(embedded, ids, greedy(n)) for rid, ids, n in chosen}
    for config in ({"max_num_batched_tokens": 16}, {"num_kv_blocks": 6, "max_num_batched_tokens": 64},
                   {"enable_chunked_prefill": False, "max_num_batched_tokens": 1024}):
        engine = engine_for(embedded, check_integrity=True, **config)
        for rid, ids, n in chosen:
            engine.add_request(rid, ids, greedy(n))
        done = run_all(engine)
        if "num_kv_blocks" in config:
            assert engine.stats().num_preemptions > 0
        for rid, _, _ in chosen:
            assert done[(rid, 0)].token_ids == reference[rid], (config, rid)


def test_admission_control_rejects_at_once_and_serves_the_rest(embedded):
    engine = engine_for(embedded, num_kv_blocks=8, max_model_len=256)
    tok = embedded.tokenizer
    engine.add_request("ok", tok.encode("Hello"), greedy(4))
    with pytest.raises(RequestRejectedError, match="exceeds the maximum context length 256"):
        engine.add_request("long", [1] * 250, greedy(10))
    with pytest.raises(RequestRejectedError, match="KV blocks but the whole KV cache has 8"):
        engine.add_request("big", [1] * 150, greedy(10))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], greedy(4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", [49152], greedy(4))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("bad-stop", [1], greedy(4, stop_token_ids=[10**6]))
    start = time.perf_counter()  # refused before anything is built per sample (a seed list of 2**31 would not be)
    with pytest.raises(RequestRejectedError, match="n=2147483647 samples exceed max_num_seqs"):
        engine.add_request("huge-n", [1], SamplingParams(n=2**31 - 1, max_tokens=4))
    with pytest.raises(RequestRejectedError, match="n=2147483647 samples exceed max_num_seqs"):
        engine.reserve_for_transfer("huge-n", [1], SamplingParams(n=2**31 - 1, max_tokens=4))
    assert time.perf_counter() - start < 5.0  # a seed per sample, 2**31 of them, would take minutes
    assert run_all(engine)[("ok", 0)].finish_reason == "length"


def test_kv_agent_is_called_by_reference_in_one_process(embedded):
    with LLMEngine(embedded, EngineConfig(num_kv_blocks=16, max_model_len=1024), kv_agent=ProbeAgent) as engine:
        shape = tuple(engine.executor.runner.kv_cache.data.shape)
        assert engine.call_kv_agents(ProbeAgent.where, {0: ("tag",)}) == {0: (0, os.getpid(), shape, "tag")}
        with pytest.raises(LookupError, match="rank 0 refuses"):
            engine.call_kv_agents(ProbeAgent.refuse, {0: ()})
    assert engine.executor.agent.closed
    with LLMEngine(embedded, EngineConfig(num_kv_blocks=16, max_model_len=1024)) as plain:
        with pytest.raises(ValueError, match="without a KV transfer agent"):
            plain.call_kv_agents(ProbeAgent.where, {0: ("tag",)})


def test_each_samples_first_output_says_when_it_was_first_scheduled(tiny_llama):
    """What request traces split a replica's queue from its prefill with: the output carrying a sample's first
    token holds the engine's time of its first scheduling (a chunked prompt: its first chunk's step), the other
    outputs None; a request waiting behind another is scheduled later."""
    engine = engine_for(tiny_llama, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=256)
    engine.add_request("a", list(range(40)), greedy(3))  # three prefill chunks
    engine.add_request("b", list(range(50, 60)), greedy(2))  # waits for "a" (one sequence at a time)
    added = time.monotonic()
    outputs: dict[str, list] = defaultdict(list)
    first_chunk_done = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append((output, time.monotonic()))
        first_chunk_done = first_chunk_done or time.monotonic()
    for rid, count in (("a", 3), ("b", 2)):
        (first, seen), *rest = outputs[rid]
        assert len(outputs[rid]) == count and all(o.scheduled_at is None for o, _ in rest)
        assert added <= first.scheduled_at <= seen
    assert outputs["a"][0][0].scheduled_at <= first_chunk_done  # the first chunk, not the last
    assert outputs["b"][0][0].scheduled_at >= outputs["a"][-1][1]


def test_a_request_preempted_by_a_higher_priority_gives_the_same_tokens(tiny_llama):
    """Priority preemption (scheduling preempt_after_s) on the model: the low-priority request, preempted
    mid-decode for a high-priority one, recomputes and ends with the tokens it gives alone."""
    from tandem.engine.engine_config import SchedulingConfig

    low_prompt, high_prompt = list(range(3, 40)), list(range(60, 75))
    scheduling = SchedulingConfig(policy="priority", preempt_after_s=0.0)
    engine = engine_for(tiny_llama, max_num_seqs=1, max_model_len=256, scheduling=scheduling)
    engine.add_request("low", low_prompt, greedy(24, seed=1), priority=5)
    done = defaultdict(Completion)
    for _ in range(4):
        collect(engine.step(), done)
    engine.add_request("high", high_prompt, greedy(6, seed=2), priority=0)
    for key, completion in run_all(engine).items():
        done[key].token_ids += completion.token_ids
    assert engine.stats().num_preemptions == 1
    for rid, ids, params in (("low", low_prompt, greedy(24, seed=1)), ("high", high_prompt, greedy(6, seed=2))):
        alone_engine = engine_for(tiny_llama, max_model_len=256)
        alone_engine.add_request(rid, ids, params)
        assert done[(rid, 0)].token_ids == run_all(alone_engine)[(rid, 0)].token_ids, rid
