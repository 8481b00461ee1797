"""Resuming a request from delivered tokens (engine/core/resume.py), on the embedded model: for greedy, seeded
sampling, penalties and a stop string, a run resumed after its first k output tokens streams exactly what the
uninterrupted run streamed after them (token ids, text deltas, finish reason, usage), and holds no block after."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.core.async_engine import AsyncEngine
from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea,"
MAX_TOKENS = 24
CUTS = (1, 5, 17)


def engine_for(loaded, **config) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**({"num_kv_blocks": 64, "max_model_len": 512, "block_size": 16,
                                              "check_integrity": True} | config)))


def outputs_of(engine: LLMEngine, request_id: str) -> list[RequestOutput]:
    """Steps until idle (checking KV integrity each step); the request's outputs, in order."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
        engine.check_integrity()
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def check_resumes(engine: LLMEngine, prompt: list[int], params: SamplingParams, cuts=CUTS,
                  resume_params: SamplingParams | None = None) -> list[RequestOutput]:
    """Runs params uninterrupted, then resumed after each cut; asserts the resumed streams continue it exactly.
    resume_params: what the resumed run is sent with (default params); its seed goes in the ResumeState."""
    engine.add_request("whole", prompt, params)
    whole = outputs_of(engine, "whole")
    assert all(len(o.token_ids) == 1 for o in whole)  # one token per step: the first k outputs are k tokens
    for k in cuts:
        assert k < len(whole), f"the uninterrupted run ended after {len(whole)} tokens, before cut {k}"
        rid = f"resumed-{k}"
        engine.add_request(rid, prompt, resume_params or params,
                           resume=ResumeState(tuple(tokens(whole[:k])), params.seed))
        resumed = outputs_of(engine, rid)
        assert tokens(resumed) == tokens(whole[k:]), k
        assert text(whole[:k]) + text(resumed) == text(whole), k
        assert resumed[-1].finish_reason == whole[-1].finish_reason and resumed[-1].finished
        assert all(o.num_prompt_tokens == len(prompt) for o in resumed)
        assert all(o.num_cached_tokens <= len(prompt) for o in resumed)
        stats = engine.stats()
        assert stats.num_blocks_in_use == 0 and stats.num_running == stats.num_waiting == 0
    return whole


@pytest.fixture(scope="module")
def prompt(embedded) -> list[int]:
    return embedded.tokenizer.encode(PROMPT)


def test_greedy_resumes_exactly(embedded, prompt):
    check_resumes(engine_for(embedded), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                               ignore_eos=True))


def test_greedy_resumes_exactly_without_a_prefix_cache(embedded, prompt):
    """The replay computes prompt + delivered tokens itself (no block of the first run to reuse)."""
    check_resumes(engine_for(embedded, enable_prefix_caching=False), prompt,
                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def test_seeded_sampling_resumes_exactly(embedded, prompt):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    whole = check_resumes(engine_for(embedded), prompt, params)
    greedy = engine_for(embedded)
    greedy.add_request("g", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert tokens(outputs_of(greedy, "g")) != tokens(whole)  # it does sample: a test that could fail


def test_the_resume_states_seed_is_the_one_drawn_with(embedded, prompt):
    """A request sent without a seed (the engine would draw one) resumes with the seed the ResumeState names."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=50, seed=99, ignore_eos=True)
    check_resumes(engine_for(embedded), prompt, params, cuts=(3, 11),
                  resume_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=50, ignore_eos=True))


def test_penalties_count_delivered_tokens_as_outputs(embedded, prompt):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=7, presence_penalty=0.8,
                            frequency_penalty=0.6, repetition_penalty=1.3, ignore_eos=True)
    check_resumes(engine_for(embedded), prompt, params)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, presence_penalty=1.5, frequency_penalty=1.0,
                            repetition_penalty=1.5, ignore_eos=True)
    check_resumes(engine_for(embedded), prompt, greedy)


def test_a_stop_string_held_back_when_cut_is_held_back_by_the_replay(embedded, prompt):
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = engine_for(embedded)
    engine.add_request("plain", prompt, plain)
    ids = tokens(outputs_of(engine, "plain"))
    tok = embedded.tokenizer
    # The text of tokens 20 and 21 (one stop string over two tokens): after token 20 the matcher holds its
    # text back, so a cut at 21 leaves held text only the replay's priming can know.
    before, after = tok.decode(ids[:20]), tok.decode(ids[:22])
    assert after.startswith(before)
    stop = after[len(before):]
    assert stop.strip(), "tokens 20-21 decode to whitespace only"
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    whole = check_resumes(engine, prompt, params, cuts=(1, 5, 17, 21))
    assert whole[-1].finish_reason == "stop" and stop not in text(whole)
    # the cut at 21 did fall inside a held-back stop-string prefix
    assert text(whole[:21]) != tok.decode(ids[:21])


def test_resume_through_the_async_engine(embedded, prompt):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    reference = engine_for(embedded)
    reference.add_request("x", prompt, params)
    whole = outputs_of(reference, "x")

    async def main():
        async with AsyncEngine(engine_for(embedded)) as server:
            resumed = [o async for o in server.generate("y", prompt, params,
                                                        resume=ResumeState(tuple(tokens(whole[:4])), 5))]
            return resumed, server.stats()

    resumed, stats = asyncio.run(main())
    assert tokens(resumed) == tokens(whole[4:]) and text(whole[:4]) + text(resumed) == text(whole)
    assert stats.num_blocks_in_use == 0


def test_what_cannot_be_resumed_is_refused_and_queues_nothing(embedded, prompt):
    engine = engine_for(embedded)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("ref", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ids = tokens(outputs_of(engine, "ref"))
    with pytest.raises(ValueError, match="n=1"):
        engine.add_request("a", prompt, SamplingParams(max_tokens=8, n=2, temperature=0), resume=ResumeState((1,)))
    with pytest.raises(ValueError, match="reach max_tokens"):
        engine.add_request("b", prompt, greedy, resume=ResumeState(tuple(ids)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("c", prompt, greedy, resume=ResumeState((10**7,)))
    eos = next(iter(embedded.tokenizer.eos_token_ids))
    with pytest.raises(ValueError, match="already end the request"):
        engine.add_request("d", prompt, SamplingParams(max_tokens=8, temperature=0), resume=ResumeState((eos,)))
    stop = embedded.tokenizer.decode(ids[:2])
    with pytest.raises(ValueError, match="stop string"):
        engine.add_request("e", prompt, SamplingParams(max_tokens=8, temperature=0, stop=(stop.strip(),)),
                           resume=ResumeState(tuple(ids[:3])))
    with pytest.raises(ValueError, match=">= 0"):
        ResumeState((-1,))
    assert not engine.has_unfinished_requests() and engine.stats().num_blocks_in_use == 0
    # an id refused above is free to use
    engine.add_request("e", prompt, greedy, resume=ResumeState(tuple(ids[:3])))
    assert tokens(outputs_of(engine, "e")) == ids[3:]
