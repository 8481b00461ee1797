"""OpenAI's reply bodies built from engine outputs (router/openai_responses.py): stream chunks, whole replies and
the /v1/models list. Every body is parsed with the official `openai` package's own types."""

from __future__ import annotations

import openai.types
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.engine.core.output_processor import RequestOutput, TokenLogprob
from tandem.router.openai_responses import ResponseBuilder, models_body

VOCAB = {1: "Hello", 2: ",", 3: " wor", 4: "ld", 5: "é", 6: "!", 7: " there"}


def _out(index: int, ids: tuple[int, ...], text: str, finish: str | None = None,
         logprobs: tuple[TokenLogprob, ...] | None = None) -> RequestOutput:
    return RequestOutput("r", index, ids, text, logprobs, finish, 5, 2, finish is not None)


def _lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, tuple(top))


def _builder(kind, n=1, logprobs=False, include_usage=False) -> ResponseBuilder:
    return ResponseBuilder(kind, "resp-1", "m", 1700000000, VOCAB.__getitem__, n=n, logprobs=logprobs,
                           include_usage=include_usage)


def _completion_chunk(chunk: dict) -> openai.types.Completion:
    """The official Completion type requires a finish reason, which OpenAI's own streams leave null until a choice
    ends (the client parses chunks without validating): validate mid-stream chunks as if finished."""
    choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
    return openai.types.Completion.model_validate({**chunk, "choices": choices})


def test_chat_stream_sends_role_first_then_text_per_choice():
    b = _builder("chat", n=2)
    chunks = b.chunks([_out(0, (1,), "Hello"), _out(1, (7,), " there")])
    chunks += b.chunks([_out(0, (), ""), _out(0, (2,), ","), _out(1, (6,), "!", "length")])
    chunks += b.chunks([_out(0, (3, 4), " world", "stop")])
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert all(p.id == "resp-1" and p.model == "m" and p.created == 1700000000 and p.usage is None for p in parsed)
    assert all("usage" not in c for c in chunks)
    for index, text, finish in [(0, "Hello, world", "stop"), (1, " there!", "length")]:
        mine = [p.choices[0] for p in parsed if p.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == text
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [finish]
    assert len(parsed) == 2 + 5  # a role chunk per choice; the empty output made none


def test_chat_stream_with_usage_and_logprobs():
    b = _builder("chat", logprobs=True, include_usage=True)
    chunks = b.chunks([_out(0, (1,), "Hello", logprobs=(_lp(1, -0.5, (1, -0.5), (5, -2.0)),))])
    chunks += b.chunks([_out(0, (5,), "é", "stop", logprobs=(_lp(5, -1.25, (5, -1.25)),))])
    assert all("usage" in c and c["usage"] is None for c in chunks)
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].logprobs is None  # the role chunk
    entries = [e for p in parsed[1:] for e in p.choices[0].logprobs.content]
    assert [(e.token, e.logprob, e.bytes) for e in entries] == [("Hello", -0.5, list(b"Hello")),
                                                                ("é", -1.25, [0xC3, 0xA9])]
    assert [(t.token, t.logprob) for t in entries[0].top_logprobs] == [("Hello", -0.5), ("é", -2.0)]
    usage = ChatCompletionChunk.model_validate(b.usage_chunk(12, 2, 8))
    assert usage.choices == [] and usage.id == "resp-1"
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == (12, 2, 14)
    assert usage.usage.prompt_tokens_details.cached_tokens == 8


def test_chat_response_collects_every_choice_in_order():
    b = _builder("chat", n=2, logprobs=True)
    b.add([_out(1, (7,), " there", logprobs=(_lp(7, -0.1),)), _out(0, (1,), "Hello", logprobs=(_lp(1, -0.2),))])
    b.add([_out(1, (6,), "!", "stop", logprobs=(_lp(6, -0.3),)), _out(0, (), "", "length")])
    reply = ChatCompletion.model_validate(b.response(prompt_tokens=9, completion_tokens=3, cached_tokens=0))
    assert reply.object == "chat.completion" and reply.id == "resp-1"
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in reply.choices] == \
        [(0, "assistant", "Hello", "length"), (1, "assistant", " there!", "stop")]
    assert [[e.token for e in c.logprobs.content] for c in reply.choices] == [["Hello"], [" there", "!"]]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (9, 3, 12)


def test_chat_response_without_logprobs_has_none():
    b = _builder("chat")
    b.add([_out(0, (1, 6), "Hello!", "stop", logprobs=(_lp(1, -0.2), _lp(6, -0.1)))])
    reply = ChatCompletion.model_validate(b.response(3, 2, 0))
    assert reply.choices[0].logprobs is None and reply.choices[0].message.content == "Hello!"


def test_completion_stream_keeps_text_offsets_per_choice():
    b = _builder("completion", n=4, logprobs=True)  # two prompts of n=2: the second prompt's choices are 2 and 3
    chunks = b.chunks([_out(0, (1,), "Hello", logprobs=(_lp(1, -0.5, (1, -0.5), (7, -1.5)),))])
    chunks += b.chunks([_out(0, (3,), " wor", logprobs=(_lp(3, -0.25),))], index_offset=2)
    chunks += b.chunks([_out(0, (2, 3), ", wor", logprobs=(_lp(2, -0.1), _lp(3, -0.2)))])
    chunks += b.chunks([_out(0, (4,), "ld", "stop", logprobs=(_lp(4, -0.3),))], index_offset=2)
    chunks += b.chunks([_out(0, (4,), "ld", "length", logprobs=(_lp(4, -0.4),))])
    parsed = [_completion_chunk(c) for c in chunks]
    assert all(p.object == "text_completion" and len(p.choices) == 1 for p in parsed)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop", "length"]
    by_index: dict[int, list] = {}
    for p in parsed:
        by_index.setdefault(p.choices[0].index, []).append(p.choices[0])
    assert sorted(by_index) == [0, 2]
    assert "".join(c.text for c in by_index[0]) == "Hello, world"
    assert [o for c in by_index[0] for o in c.logprobs.text_offset] == [0, 5, 6, 10]
    assert [t for c in by_index[0] for t in c.logprobs.tokens] == ["Hello", ",", " wor", "ld"]
    assert [o for c in by_index[2] for o in c.logprobs.text_offset] == [0, 4]
    assert by_index[0][0].logprobs.top_logprobs == [{"Hello": -0.5, " there": -1.5}]
    assert by_index[0][1].logprobs.token_logprobs == [-0.1, -0.2]


def test_completion_response_and_usage_chunk():
    b = _builder("completion", n=2, logprobs=True, include_usage=True)
    b.add([_out(0, (1, 2), "Hello,", logprobs=(_lp(1, -0.5), _lp(2, -0.1)))], index_offset=1)
    b.add([_out(0, (6,), "!", "stop", logprobs=(_lp(6, -0.2, (6, -0.2)),))])
    b.add([_out(0, (3,), " wor", "length", logprobs=(_lp(3, -0.3),))], index_offset=1)
    reply = openai.types.Completion.model_validate(b.response(4, 4, 2))
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == \
        [(0, "!", "stop"), (1, "Hello, wor", "length")]
    lp = reply.choices[1].logprobs
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == (["Hello", ",", " wor"], [-0.5, -0.1, -0.3], [0, 5, 6])
    assert reply.choices[0].logprobs.top_logprobs == [{"!": -0.2}]
    assert reply.usage.total_tokens == 8 and reply.usage.prompt_tokens_details.cached_tokens == 2
    usage = openai.types.Completion.model_validate(b.usage_chunk(4, 4, 2))
    assert usage.choices == [] and usage.usage.completion_tokens == 4


def test_completion_without_logprobs_has_none():
    output = _out(0, (1,), "Hello", "stop", logprobs=(_lp(1, -0.5),))
    [chunk] = _builder("completion").chunks([output])
    assert _completion_chunk(chunk).choices[0].logprobs is None
    b = _builder("completion")
    b.add([output])
    assert openai.types.Completion.model_validate(b.response(1, 1, 0)).choices[0].logprobs is None


def test_builder_refuses_misuse():
    b = _builder("chat", n=2)
    with pytest.raises(ValueError, match="outside 0..1"):
        b.chunks([_out(0, (1,), "Hello")], index_offset=2)
    b.add([_out(0, (1,), "Hello", "stop"), _out(1, (1,), "Hello")])
    with pytest.raises(ValueError, match=r"choices \[1\] have not finished"):
        b.response(1, 2, 0)
    with pytest.raises(ValueError, match="kind"):
        ResponseBuilder("embedding", "x", "m", 0, str, n=1, logprobs=False)


def test_models_body_is_openais_model_list():
    body = models_body("SmolLM2-135M-Instruct", 1700000000, 2048)
    assert body["object"] == "list"
    [model] = [openai.types.Model.model_validate(m) for m in body["data"]]
    assert (model.id, model.object, model.created, model.owned_by) == ("SmolLM2-135M-Instruct", "model", 1700000000,
                                                                       "tandem")
    assert body["data"][0]["max_model_len"] == 2048
