"""Tool calling over structured output (router/tool_calls.py): the constraint a tool_choice asks for, the reply
turned into tool_calls (whole and streamed) in OpenAI's shapes, and the tool_choice values refused. Through the
cluster and the real model: tests/cluster/test_disaggregated.py (structured_checks.tool_calls_round_trip)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem.engine.core.output_processor import RequestOutput
from tandem.router.openai_bodies import ChatCompletionRequest, parse_body
from tandem.router.openai_errors import OpenAIError
from tandem.router.openai_requests import chat_request
from tandem.router.openai_responses import ResponseBuilder
from tandem.router.tool_calls import ToolMode, auto_supported, call_schema, hermes_calls, tool_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def _body(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "tools": TOOLS, **fields})


def _output(text: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", 0, (1,) if text else (), text, None, finish, 3, 0, finish is not None)


def test_a_named_function_constrains_the_reply_to_its_arguments():
    body = _body(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert body.tool_mode == ToolMode("get_weather")
    assert json.loads(chat_request(body, "r").sampling.structured.json_schema) == WEATHER


@pytest.mark.parametrize("parallel, max_items", [(None, None), (False, 1)])
def test_required_constrains_the_reply_to_an_array_of_calls(parallel, max_items):
    body = _body(tool_choice="required", **({} if parallel is None else {"parallel_tool_calls": parallel}))
    schema = json.loads(chat_request(body, "r").sampling.structured.json_schema)
    assert schema.get("maxItems") == max_items and schema["minItems"] == 1
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good[:1] if max_items else good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_tools_reach_the_chat_template_and_a_past_call_reaches_the_model_as_json():
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    body = parse_body(ChatCompletionRequest, {"model": "m", "tools": TOOLS, "tool_choice": "none", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]})
    request = chat_request(body, "r")
    assert [(t.name, t.description) for t in request.chat.tools] == [("get_weather", "Weather in a city"),
                                                                      ("get_time", "")]
    assert json.loads(request.chat.tools[0].parameters_json) == WEATHER
    assert json.loads(request.chat.messages[1].content) == [call["function"]]
    assert request.chat.messages[2].content == "12:00" and not request.sampling.HasField("structured")


def test_auto_is_the_default_with_tools_and_asks_for_no_constraint():
    for body in (_body(), _body(tool_choice="auto")):
        assert body.tool_mode == ToolMode(None, auto=True)
        assert not chat_request(body, "r").sampling.HasField("structured")
    assert _body(tool_choice="none").tool_mode is None


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "not both"),
])
def test_tool_choices_tandem_cannot_serve_are_400s(fields, message):
    with pytest.raises(OpenAIError, match=re.escape(message)):
        _body(**fields)
    with pytest.raises(OpenAIError, match="tool_choice needs tools"):
        parse_body(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                           "tool_choice": "required"})
    with pytest.raises(OpenAIError, match="distinct function names"):
        _body(tools=TOOLS + TOOLS[:1], tool_choice="required")


def test_replies_become_tool_calls_unless_cut_short():
    named, required = ToolMode("get_weather"), ToolMode(None)
    (call,) = tool_calls(named, '{"city": "Oslo"}')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} and call["id"].startswith("call_")
    calls = tool_calls(required, '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                 '"arguments": {"city": "Rome"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert tool_calls(named, '{"city": "Os') is None and tool_calls(required, '{"name": "x"}') is None


def _builder(mode: ToolMode) -> ResponseBuilder:
    return ResponseBuilder("chat", "chatcmpl-1", "m", 0, str, n=1, logprobs=False, tool_mode=mode)


def test_whole_replies_carry_tool_calls_and_finish_as_openai_does():
    builder = _builder(ToolMode(None))
    builder.add([_output('[{"name": "get_time", '), _output('"arguments": {}}]', "stop")])
    (choice,) = builder.response(3, 2, 0)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    named = _builder(ToolMode("get_weather"))
    named.add([_output('{"city": "Oslo"}', "stop")])
    (choice,) = named.response(3, 2, 0)["choices"]
    assert choice["finish_reason"] == "stop" and json.loads(choice["message"]["tool_calls"][0]["function"]
                                                           ["arguments"]) == {"city": "Oslo"}
    cut = _builder(ToolMode("get_weather"))
    cut.add([_output('{"city": "Os', "length")])
    (choice,) = cut.response(3, 2, 0)["choices"]
    assert choice["message"] == {"role": "assistant", "content": '{"city": "Os'} and choice["finish_reason"] == "length"


def test_a_named_call_streams_its_arguments_and_required_calls_arrive_whole():
    builder = _builder(ToolMode("get_weather"))
    chunks = builder.chunks([_output('{"city"')]) + builder.chunks([_output(': "Oslo"}', "stop")])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"].startswith("call_")
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:] if "tool_calls" in d)
    assert json.loads(arguments) == {"city": "Oslo"} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    required = _builder(ToolMode(None))
    assert required.chunks([_output('[{"name": "get_time", ')]) == []
    chunks = required.chunks([_output('"arguments": {}}]', "stop")])
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


HERMES_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools> Call one as <tool_call>{...}</tool_call>\n"
                   "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


def test_auto_is_served_only_for_templates_that_render_tools_and_write_hermes_calls():
    assert auto_supported(HERMES_TEMPLATE)
    assert not auto_supported("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not auto_supported("{{ tools }} {% for m in messages %}{{ m.content }}{% endfor %}")


def test_auto_replies_split_into_content_and_hermes_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = hermes_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert hermes_calls("no call here") is None
    assert hermes_calls('<tool_call>{"name": "get_time", "argu</tool_call>') is None  # broken JSON stays text
    builder = _builder(ToolMode(None, auto=True))
    builder.add([_output(text, "stop")])
    (choice,) = builder.response(3, 2, 0)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert len(choice["message"]["tool_calls"]) == 2
    plain = _builder(ToolMode(None, auto=True))
    chunks = plain.chunks([_output("Hello", None)]) + plain.chunks([_output(" there", "stop")])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello there"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_auto_through_the_api_for_a_hermes_template_and_a_400_for_the_embedded_models():
    import openai

    from tandem.engine.tokenizer import Tokenizer
    from tandem.router.mocks.replicas import MockDecode, MockPrefill
    from tests.router.test_http_api import Server, embedded

    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")])
    try:
        with pytest.raises(openai.BadRequestError, match="needs a chat template that renders tools"):
            plain.client().chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS)
    finally:
        plain.close()
    tok = embedded().tokenizer
    hermes = Tokenizer(tok.backend, chat_template=HERMES_TEMPLATE, bos_token=tok.bos_token, eos_token=tok.eos_token,
                       eos_token_ids=tok.eos_token_ids)
    server = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")], tokenizer=hermes)
    try:
        reply = server.client().chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                        tools=TOOLS, max_tokens=4)
        # the mock replicas write no call: the reply is text
        assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    finally:
        server.close()
