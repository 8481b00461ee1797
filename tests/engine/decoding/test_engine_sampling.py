"""Sampling features end to end through the engine on the embedded model."""

from __future__ import annotations

import math

import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams

from tests.engine.engine_helpers import run_all


def make(loaded) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=128, max_model_len=512))


def run_one(loaded, prompt, params, others=()):
    engine = make(loaded)
    for i, (other_prompt, other_params) in enumerate(others):
        engine.add_request(f"other{i}", other_prompt, other_params)
    engine.add_request("x", prompt, params)
    done = run_all(engine)
    return [done[("x", i)] for i in range(params.n)]


def test_seeded_samples_do_not_depend_on_the_batch(embedded):
    tok = embedded.tokenizer
    prompt = tok.encode("Write a short poem about the sea.")
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run_one(embedded, prompt, params)[0]
    noisy = [(tok.encode(t), SamplingParams(max_tokens=n, temperature=0.7, ignore_eos=True))
             for t, n in (("Hello there", 20), ("Numbers: 1, 2,", 9), ("A long time ago " * 5, 14))]
    batched = run_one(embedded, prompt, params, noisy)[0]
    assert batched.token_ids == alone.token_ids
    other_seed = run_one(embedded, prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99,
                                                           ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


def test_n_samples_share_the_prompt_and_differ(embedded):
    prompt = embedded.tokenizer.encode("My favourite animal is")
    samples = run_one(embedded, prompt, SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=5, ignore_eos=True))
    assert len({tuple(s.token_ids) for s in samples}) > 1
    # sample i is seeded with seed + i, so it equals a single-sample request with that seed
    second = run_one(embedded, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=6, ignore_eos=True))[0]
    assert samples[1].token_ids == second.token_ids
    greedy = run_one(embedded, prompt, SamplingParams(max_tokens=12, temperature=0, n=3, ignore_eos=True))
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids


def test_stop_strings_end_the_output_before_them_across_token_boundaries(embedded):
    tok = embedded.tokenizer
    prompt = tok.encode("The capital of France is")
    full = run_one(embedded, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    cut = len(pieces[4]) - 1
    stop = full.text[cut:cut + 5]
    assert len(stop) == 5 and full.text.find(stop) == cut
    stopped = run_one(embedded, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert stopped.text == full.text[:cut]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < 24


def test_logprobs_match_the_model_distribution(embedded, embedded_generator):
    prompt = embedded.tokenizer.encode("One, two, three,")
    out = run_one(embedded, prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=5, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    first = out.logprobs[0]
    reference = torch.log_softmax(embedded_generator.prompt_logits(prompt), -1)
    top = torch.topk(reference, 5)
    assert [t for t, _ in first.top_logprobs] == top.indices.tolist()
    assert first.token_id == top.indices[0].item()  # greedy picks the most likely
    assert math.isclose(first.logprob, reference[first.token_id].item(), abs_tol=1e-4)
    assert all(b <= a for (_, a), (_, b) in zip(first.top_logprobs, first.top_logprobs[1:]))


def test_penalties_change_a_repetitive_continuation(embedded):
    prompt = embedded.tokenizer.encode("the the the the the the")  # greedy continues "-in-the-..." with repeats
    plain = run_one(embedded, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    penalized = run_one(embedded, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                         repetition_penalty=2.0, frequency_penalty=1.0))[0]
    def repeats(ids):
        return len(ids) - len(set(ids))

    assert repeats(plain.token_ids) >= 2 and repeats(penalized.token_ids) < repeats(plain.token_ids)
