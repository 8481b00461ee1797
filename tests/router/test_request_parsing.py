"""What the router makes of a gRPC GenerateRequest before any replica sees it: the prompt's token ids, the
sampling parameters (defaults, seeds) and the request id, or an InvalidRequest with the status a client gets."""

from __future__ import annotations

import re

import pytest

from tandem.engine.loader import load_model
from tandem.router.client import build_request
from tandem.router.request_parsing import DEFAULT_MAX_TOKENS, InvalidRequest, ModelFacts, parse_request

MODEL_ID = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    loaded = load_model(None, weights=False, progress=False)
    return ModelFacts(MODEL_ID, loaded.tokenizer, loaded.config.vocab_size, MAX_MODEL_LEN)


def _parse(facts: ModelFacts, **kwargs):
    return parse_request(build_request(**kwargs), facts)


# --- prompts -----------------------------------------------------------------------------------------------------


def test_text_prompt_is_tokenized_as_is(facts):
    text = "The capital of France is"
    parsed = _parse(facts, prompt=text)
    assert parsed.prompt_token_ids == tuple(facts.tokenizer.encode(text))
    assert len(parsed.prompt_token_ids) > 1


def test_chat_prompt_uses_the_chat_template(facts):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    parsed = _parse(facts, chat=chat)
    assert parsed.prompt_token_ids == tuple(facts.tokenizer.encode_chat(chat))
    assert parsed.prompt_token_ids != tuple(facts.tokenizer.encode("Hi"))


def test_token_ids_pass_through(facts):
    ids = [0, 1, 17, 905, facts.vocab_size - 1]
    assert _parse(facts, token_ids=ids).prompt_token_ids == tuple(ids)


def test_the_served_model_id_and_an_empty_one_are_accepted(facts):
    assert _parse(facts, prompt="Hi", model=MODEL_ID).prompt_token_ids
    assert _parse(facts, prompt="Hi", model="").prompt_token_ids


# --- refused requests --------------------------------------------------------------------------------------------

INVALID = {
    "no prompt": (lambda v: {}, "INVALID_ARGUMENT", "has no prompt"),
    "empty text": (lambda v: {"prompt": ""}, "INVALID_ARGUMENT", "prompt text is empty"),
    "empty token_ids": (lambda v: {"token_ids": []}, "INVALID_ARGUMENT", "token_ids is empty"),
    "token id = vocab size": (lambda v: {"token_ids": [1, v, 2]}, "INVALID_ARGUMENT",
                              "token id {v} is outside the vocabulary (0..{last})"),
    "negative token id": (lambda v: {"token_ids": [-1]}, "INVALID_ARGUMENT", "token id -1 is outside the vocabulary"),
    "empty chat": (lambda v: {"chat": []}, "INVALID_ARGUMENT", "chat has no messages"),
    "bad role": (lambda v: {"chat": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
                 "INVALID_ARGUMENT", "chat.messages[1].role 'robot' is not one of"),
    "unknown model": (lambda v: {"prompt": "Hi", "model": "gpt-4"}, "NOT_FOUND",
                      f"model 'gpt-4' is not served here; this cluster serves '{MODEL_ID}'"),
    "negative temperature": (lambda v: {"prompt": "Hi", "temperature": -1.0}, "INVALID_ARGUMENT",
                             "sampling: temperature must be >= 0"),
    "top_p 0": (lambda v: {"prompt": "Hi", "top_p": 0.0}, "INVALID_ARGUMENT", "sampling: top_p must be in (0, 1]"),
    "logprobs 99": (lambda v: {"prompt": "Hi", "logprobs": 99}, "INVALID_ARGUMENT",
                    "logprobs=99 asks for more alternatives than this server gives (20)"),
    "max_tokens 0": (lambda v: {"prompt": "Hi", "max_tokens": 0}, "INVALID_ARGUMENT",
                     "sampling: max_tokens must be at least 1"),
    "stop token out of vocab": (lambda v: {"prompt": "Hi", "stop_token_ids": [2, v]}, "INVALID_ARGUMENT",
                                "stop_token_ids: token id {v} is outside the vocabulary"),
    "negative stop token": (lambda v: {"prompt": "Hi", "stop_token_ids": [-3]}, "INVALID_ARGUMENT",
                            "stop_token_ids must be >= 0"),
    "prompt + max_tokens too long": (lambda v: {"token_ids": [1] * 2000, "max_tokens": 100}, "INVALID_ARGUMENT",
                                     "the prompt (2000 tokens) + max_tokens (100) = 2100 exceeds the maximum "
                                     f"context length {MAX_MODEL_LEN}"),
    "prompt fills the context": (lambda v: {"token_ids": [1] * MAX_MODEL_LEN}, "INVALID_ARGUMENT",
                                 f"exceeds the maximum context length {MAX_MODEL_LEN}"),
    "request_id with /": (lambda v: {"prompt": "Hi", "request_id": "a/b"}, "INVALID_ARGUMENT", "request_id"),
    "request_id with #": (lambda v: {"prompt": "Hi", "request_id": "a#b"}, "INVALID_ARGUMENT", "request_id"),
    "request_id 200 chars": (lambda v: {"prompt": "Hi", "request_id": "r" * 200}, "INVALID_ARGUMENT",
                             "request_id must be at most 128 printable characters"),
    "request_id unprintable": (lambda v: {"prompt": "Hi", "request_id": "a\nb"}, "INVALID_ARGUMENT", "request_id"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_requests_are_refused_with_status_and_reason(facts, case):
    build, code, message = INVALID[case]
    with pytest.raises(InvalidRequest) as info:
        _parse(facts, **build(facts.vocab_size))
    assert info.value.code == code
    assert message.format(v=facts.vocab_size, last=facts.vocab_size - 1) in str(info.value)


def test_the_longest_request_ids_still_accepted(facts):
    assert _parse(facts, prompt="Hi", request_id="r" * 128).request_id == "r" * 128


# --- sampling defaults -------------------------------------------------------------------------------------------


def test_default_max_tokens_is_capped_by_the_context(facts):
    assert _parse(facts, prompt="Hi").params.max_tokens == DEFAULT_MAX_TOKENS == 256
    assert _parse(facts, token_ids=[1] * 1900).params.max_tokens == MAX_MODEL_LEN - 1900
    assert _parse(facts, token_ids=[1] * (MAX_MODEL_LEN - 1)).params.max_tokens == 1
    assert _parse(facts, prompt="Hi", max_tokens=7).params.max_tokens == 7


def test_sampling_fields_reach_the_params(facts):
    params = _parse(facts, prompt="Hi", n=2, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
                    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, ignore_eos=True,
                    stop_token_ids=[2, 7], stop=["\n\n", "END"], logprobs=3, speculative_tokens=0).params
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (2, 0.5, 0.9, 40, 0.05)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.1, 0.5, -0.5)
    assert params.ignore_eos is True
    assert params.stop_token_ids == (2, 7) and params.stop == ("\n\n", "END") and params.logprobs == 3
    assert params.speculative_tokens == 0 and _parse(facts, prompt="Hi").params.speculative_tokens is None
    with pytest.raises(InvalidRequest, match="speculative_tokens must be in"):
        _parse(facts, prompt="Hi", speculative_tokens=99)


def test_a_sampled_request_without_seed_gets_one_drawn_once(facts):
    first = _parse(facts, prompt="Hi", temperature=0.8).params.seed
    second = _parse(facts, prompt="Hi", temperature=0.8).params.seed
    assert isinstance(first, int) and isinstance(second, int)
    assert 0 <= first < 2**62 and 0 <= second < 2**62
    assert first != second


def test_a_greedy_request_keeps_no_seed(facts):
    params = _parse(facts, prompt="Hi", temperature=0.0).params
    assert params.greedy and params.seed is None


def test_an_explicit_seed_is_kept(facts):
    assert _parse(facts, prompt="Hi", temperature=0.8, seed=1234).params.seed == 1234
    assert _parse(facts, prompt="Hi", temperature=0.0, seed=0).params.seed == 0


# --- ids and priority --------------------------------------------------------------------------------------------


def test_an_empty_request_id_gets_a_generated_one(facts):
    first = _parse(facts, prompt="Hi").request_id
    second = _parse(facts, prompt="Hi").request_id
    assert re.fullmatch(r"req-[0-9a-f]{16}", first) and re.fullmatch(r"req-[0-9a-f]{16}", second)
    assert first != second


def test_a_given_request_id_and_priority_are_kept(facts):
    parsed = _parse(facts, prompt="Hi", request_id="client-42.a_b", priority=-3)
    assert parsed.request_id == "client-42.a_b"
    assert parsed.priority == -3
