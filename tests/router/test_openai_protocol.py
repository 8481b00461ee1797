"""OpenAI's HTTP bodies to and from tandem's gRPC request: what a client of /v1/chat/completions, /v1/completions and
/v1/models sends and gets back. Every reply body is parsed with the official `openai` package's own types."""

from __future__ import annotations

import openai.types
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.engine.output_processor import RequestOutput, TokenLogprob
from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    ResponseBuilder,
    chat_request,
    completion_requests,
    http_status_for,
    models_body,
    parse_body,
)

USER = [{"role": "user", "content": "Hi"}]
VOCAB = {1: "Hello", 2: ",", 3: " wor", 4: "ld", 5: "é", 6: "!", 7: " there"}
OPTIONAL_SAMPLING = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence]


def _chat(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, {"model": "m", "messages": USER, **fields})


def _completion(**fields) -> CompletionRequest:
    return parse_body(CompletionRequest, {"model": "m", "prompt": "Once", **fields})


def _refused(model_cls, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parse_body(model_cls, body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert e.value.body()["error"]["message"] == e.value.message
    return e.value


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


# --- errors ----------------------------------------------------------------------------------------------------------


def test_error_body_has_openais_shape():
    e = OpenAIError(404, "model 'x' is not served here", "invalid_request_error", param="model",
                    code="model_not_found")
    assert e.status == 404 and str(e) == "model 'x' is not served here"
    assert e.body() == {"error": {"message": "model 'x' is not served here", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}}


@pytest.mark.parametrize("code, expected", [
    ("INVALID_ARGUMENT", (400, "invalid_request_error")), ("NOT_FOUND", (404, "invalid_request_error")),
    ("ALREADY_EXISTS", (409, "invalid_request_error")), ("RESOURCE_EXHAUSTED", (429, "rate_limit_error")),
    ("UNAUTHENTICATED", (401, "authentication_error")), ("PERMISSION_DENIED", (403, "permission_error")),
    ("UNAVAILABLE", (503, "service_unavailable_error")), ("CANCELLED", (499, "request_cancelled")),
    ("DEADLINE_EXCEEDED", (504, "timeout_error")), ("INTERNAL", (500, "internal_error")),
    ("DATA_LOSS", (500, "internal_error")), ("NOT_A_CODE", (500, "internal_error")),
])
def test_grpc_status_maps_to_http_status(code, expected):
    assert http_status_for(code) == expected


# --- parsing bodies ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [[USER], "hello", 3, None, b"[1, 2]"])
def test_a_body_that_is_not_a_json_object_is_refused(data):
    assert _refused(ChatCompletionRequest, data).message == "the request body must be a JSON object"


def test_raw_bytes_are_parsed_as_json():
    body = parse_body(CompletionRequest, b'{"model": "m", "prompt": "Once", "max_tokens": 3}')
    assert body.prompt == "Once" and body.max_tokens == 3
    assert _refused(CompletionRequest, b'{"model": ').message == "the request body is not valid JSON"


def test_unknown_fields_are_refused_with_openais_wording():
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": USER, "temprature": 0.5})
    assert (e.message, e.param) == ("Unrecognized request argument supplied: temprature", "temprature")
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "Hi", "x": 1}]})
    assert (e.message, e.param) == ("Unrecognized request argument supplied: messages[0].x", "messages[0].x")
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": USER, "stream": True,
                                         "stream_options": {"include_usage": True, "usage": 1}})
    assert e.param == "stream_options.usage"


def test_fields_of_the_other_endpoint_are_unknown():
    assert _refused(CompletionRequest, {"model": "m", "prompt": "a", "messages": USER}).param == "messages"
    assert _refused(CompletionRequest, {"model": "m", "prompt": "a", "top_logprobs": 2}).param == "top_logprobs"
    assert _refused(ChatCompletionRequest, {"model": "m", "messages": USER, "prompt": "a"}).param == "prompt"
    assert _refused(ChatCompletionRequest, {"model": "m", "messages": USER, "echo": True}).param == "echo"


CHAT_UNSUPPORTED = [
    ("tools", [{"type": "function", "function": {"name": "f"}}], []),
    ("tool_choice", "auto", "none"),
    ("functions", [{"name": "f"}], []),
    ("function_call", "auto", "none"),
    ("parallel_tool_calls", False, True),
    ("response_format", {"type": "json_object"}, {"type": "text"}),
    ("logit_bias", {"50256": -100}, {}),
    ("audio", {"voice": "alloy", "format": "wav"}, None),
    ("modalities", ["text", "audio"], ["text"]),
    ("prediction", {"type": "content", "content": "x"}, None),
]


@pytest.mark.parametrize("name, value, default", CHAT_UNSUPPORTED)
def test_chat_fields_tandem_cannot_honour_are_refused_unless_default(name, value, default):
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": USER, name: value})
    assert (e.message, e.param) == (f"{name} is not supported by tandem", name)
    assert chat_request(_chat(**{name: default}), "r") == chat_request(_chat(), "r")


@pytest.mark.parametrize("name, value, default", [
    ("logit_bias", {"1": 5}, {}), ("echo", True, False), ("suffix", "end", ""), ("best_of", 3, 1),
])
def test_completion_fields_tandem_cannot_honour_are_refused_unless_default(name, value, default):
    e = _refused(CompletionRequest, {"model": "m", "prompt": "a", name: value})
    assert e.message.startswith(f"{name} is not supported by tandem") and e.param == name
    assert completion_requests(_completion(**{name: default}), "r") == completion_requests(_completion(), "r")


def test_best_of_equal_to_n_is_accepted():
    assert _completion(n=3, best_of=3).best_of == 3
    assert _refused(CompletionRequest, {"model": "m", "prompt": "a", "n": 2, "best_of": 3}).param == "best_of"


def test_message_fields_tandem_cannot_honour_are_refused():
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": call}]})
    assert (e.message, e.param) == ("messages[1].tool_calls is not supported by tandem", "messages[1].tool_calls")


@pytest.mark.parametrize("field, value, words", [
    ("temperature", "0.5", "valid number"), ("temperature", float("nan"), "finite"), ("max_tokens", 1.5, "integer"),
    ("n", True, "integer"), ("stream", "yes", "boolean"), ("max_tokens", 2**40, "less than or equal"),
    ("seed", "7", "integer"), ("stop", [1, 2], "string or a list of strings"), ("user", 3, "string"),
    ("stop_token_ids", [1, "2"], "integer"), ("session_id", 5, "string"),
])
def test_wrongly_typed_fields_are_refused_with_their_path(field, value, words):
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": USER, field: value})
    assert e.param is not None and e.param.startswith(field) and e.message.startswith(f"{e.param}: ")
    assert words in e.message


def test_model_and_messages_are_required():
    e = _refused(ChatCompletionRequest, {"messages": USER})
    assert e.param == "model" and "required" in e.message
    assert _refused(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"
    assert _refused(CompletionRequest, {"model": "m"}).param == "prompt"


def test_top_logprobs_needs_logprobs():
    for extra in ({}, {"logprobs": False}):
        e = _refused(ChatCompletionRequest, {"model": "m", "messages": USER, "top_logprobs": 3, **extra})
        assert (e.message, e.param) == ("top_logprobs requires logprobs to be true", "top_logprobs")
    assert _chat(logprobs=True, top_logprobs=3).top_logprobs == 3


def test_stream_options_need_stream():
    for extra in ({}, {"stream": False}):
        e = _refused(CompletionRequest, {"model": "m", "prompt": "a", "stream_options": {"include_usage": True},
                                         **extra})
        assert e.param == "stream_options" and "only allowed when 'stream' is enabled" in e.message
    assert _completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not _completion(stream=True).include_usage


def test_message_roles_and_null_content():
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    assert e.param == "messages[0].role" and "'robot'" in e.message
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": None}]})
    assert e.param == "messages[0].content" and "null only in assistant messages" in e.message
    assert _refused(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}]}).param == \
        "messages[0].content"
    body = _chat(messages=USER + [{"role": "assistant", "content": None}, {"role": "user", "content": "Go on"}])
    assert [m.content for m in chat_request(body, "r").chat.messages] == ["Hi", "", "Go on"]


def test_text_content_parts_are_joined_and_other_parts_refused():
    parts = [{"type": "text", "text": "Describe:"}, {"type": "text", "text": "a cat"}]
    body = _chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}])
    assert [(m.role, m.content) for m in chat_request(body, "r").chat.messages] == \
        [("system", "Be brief."), ("user", "Describe:\na cat")]
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [parts[0], image]}]})
    assert e.param == "messages[0].content"
    assert "part 1 has type 'image_url'" in e.message and "not supported by tandem" in e.message
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert e.param == "messages[0].content" and "'text'" in e.message


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], ["a"]], 1.5, [-1], [True], [1, [2]], {"text": "a"}])
def test_malformed_prompts_are_refused(prompt):
    assert _refused(CompletionRequest, {"model": "m", "prompt": prompt}).param == "prompt"


# --- bodies -> pb.GenerateRequest ----------------------------------------------------------------------------------


def test_every_chat_field_lands_in_its_grpc_field():
    body = _chat(n=2, max_tokens=10, max_completion_tokens=20, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                 repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.25, seed=7, stop=["\n", "END"],
                 logprobs=True, top_logprobs=3, ignore_eos=True, stop_token_ids=[2, 3], priority=-1,
                 session_id="conv-9", user="alice", stream=True, stream_options={"include_usage": True})
    assert body.user == "alice"
    r = chat_request(body, "req-1")
    assert (r.request_id, r.model, r.priority, r.session_id) == ("req-1", "m", -1, "conv-9")
    assert [(m.role, m.content) for m in r.chat.messages] == [("user", "Hi")]
    s = r.sampling
    assert (s.n, s.max_tokens, s.top_k, s.seed, s.logprobs) == (2, 20, 40, 7, 3)
    assert (s.temperature, s.top_p, s.min_p) == pytest.approx((0.7, 0.9, 0.05))
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == pytest.approx((1.1, 0.5, 0.25))
    assert s.ignore_eos and list(s.stop) == ["\n", "END"] and list(s.stop_token_ids) == [2, 3]
    assert all(s.HasField(name) for name in OPTIONAL_SAMPLING)


def test_unset_chat_fields_stay_unset():
    r = chat_request(_chat(), "req-1")
    assert [name for name in OPTIONAL_SAMPLING if r.sampling.HasField(name)] == []
    assert not r.sampling.ignore_eos and not r.sampling.stop and not r.sampling.stop_token_ids
    assert (r.priority, r.session_id, r.WhichOneof("prompt")) == (0, "", "chat")


def test_chat_token_limits_and_logprobs():
    assert chat_request(_chat(max_tokens=10), "r").sampling.max_tokens == 10
    assert chat_request(_chat(max_completion_tokens=5, max_tokens=10), "r").sampling.max_tokens == 5
    assert chat_request(_chat(logprobs=True), "r").sampling.logprobs == 0
    assert not chat_request(_chat(logprobs=False), "r").sampling.HasField("logprobs")
    assert list(chat_request(_chat(stop="END"), "r").sampling.stop) == ["END"]


def test_completion_fields_land_in_their_grpc_fields():
    [r] = completion_requests(_completion(max_tokens=8, logprobs=2, temperature=0.0, seed=3, stop="\n",
                                          priority=4, session_id="s"), "cmpl-1")
    assert (r.request_id, r.text, r.priority, r.session_id) == ("cmpl-1", "Once", 4, "s")
    assert (r.sampling.max_tokens, r.sampling.logprobs, r.sampling.seed, list(r.sampling.stop)) == (8, 2, 3, ["\n"])
    assert r.sampling.HasField("temperature") and r.sampling.temperature == 0.0
    assert not r.sampling.HasField("n") and not r.sampling.HasField("top_p")
    [r] = completion_requests(_completion(logprobs=0), "cmpl-1")
    assert r.sampling.HasField("logprobs") and r.sampling.logprobs == 0


@pytest.mark.parametrize("prompt, expected", [
    ("Once", [("cmpl", "text", "Once")]),
    ([5, 6, 7], [("cmpl", "token_ids", [5, 6, 7])]),
    (["Only"], [("cmpl", "text", "Only")]),
    (["A", "B", "C"], [("cmpl-0", "text", "A"), ("cmpl-1", "text", "B"), ("cmpl-2", "text", "C")]),
    ([[1, 2], [3]], [("cmpl-0", "token_ids", [1, 2]), ("cmpl-1", "token_ids", [3])]),
])
def test_a_batched_prompt_makes_one_request_per_prompt(prompt, expected):
    requests = completion_requests(_completion(prompt=prompt, n=2, max_tokens=4), "cmpl")
    got = [(r.request_id, r.WhichOneof("prompt"),
            r.text if r.WhichOneof("prompt") == "text" else list(r.token_ids.ids)) for r in requests]
    assert got == expected
    assert all(r.sampling.n == 2 and r.sampling.max_tokens == 4 for r in requests)


def test_text_protobuf_cannot_encode_is_a_400():
    with pytest.raises(OpenAIError) as e:
        chat_request(_chat(messages=[{"role": "user", "content": "bad \ud800"}]), "r")
    assert e.value.status == 400 and "UTF-8" in e.value.message
    with pytest.raises(OpenAIError):
        completion_requests(_completion(prompt=["ok", "\udfff"]), "r")


# --- replies -------------------------------------------------------------------------------------------------------


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
