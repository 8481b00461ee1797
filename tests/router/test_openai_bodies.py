"""OpenAI's request bodies (router/openai_bodies.py): what a client of /v1/chat/completions and /v1/completions
may send, and the 400 it gets, in OpenAI's wording, for anything else."""

from __future__ import annotations

import pytest

from tandem.router.openai_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from tandem.router.openai_errors import OpenAIError
from tandem.router.openai_requests import chat_request, completion_requests

USER = [{"role": "user", "content": "Hi"}]


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
    ("functions", [{"name": "f"}], []),
    ("function_call", "auto", "none"),
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
    e = _refused(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "function_call": {"name": "f"}}]})
    assert (e.message, e.param) == ("messages[1].function_call is not supported by tandem",
                                    "messages[1].function_call")


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
