"""Structured output at the front doors: response_format and vLLM's structured_outputs in OpenAI bodies, the
gRPC field they map to, and the router refusing a constraint the compiler rejects (400 / INVALID_ARGUMENT with the
compiler's message) before any replica sees it. The constraint's effect on the model's output is tested in
tests/engine/decoding/test_structured_output.py and, through the whole cluster,
tests/cluster/test_structured_cluster.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tandem.engine.loader import load_model
from tandem.engine.structured_output import StructuredOutput
from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.client import build_request
from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tandem.router.openai_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from tandem.router.openai_errors import OpenAIError
from tandem.router.openai_requests import chat_request, completion_requests
from tandem.router.request_parsing import InvalidRequest, ModelFacts, parse_request
from tests.router.test_http_api import Server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    loaded = load_model(None, weights=False, progress=False)
    return ModelFacts("m", loaded.tokenizer, loaded.config.vocab_size, 2048)


@pytest.mark.parametrize("extra, expected", [
    ({"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
     pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, pb.StructuredOutput(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, pb.StructuredOutput(choice=pb.Choices(choices=["a", "b"]))),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, pb.StructuredOutput(grammar='root ::= "x"')),
])
def test_chat_bodies_map_their_constraint_onto_the_request(extra, expected):
    sampling = chat_request(parse_body(ChatCompletionRequest, CHAT | extra), "r").sampling
    assert (sampling.structured if sampling.HasField("structured") else None) == expected


def test_completion_bodies_take_structured_outputs():
    body = parse_body(CompletionRequest, {"model": "m", "prompt": "x", "structured_outputs": {"regex": "a+"}})
    assert completion_requests(body, "r")[0].sampling.structured == pb.StructuredOutput(regex="a+")


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "xml"}}, "is not one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": {}}}}, "json_schema.name"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
    ({"structured_outputs": {"xml": "<a/>"}}, "exactly one of"),
])
def test_malformed_constraint_fields_are_400s(extra, message):
    with pytest.raises(OpenAIError, match=message) as e:
        parse_body(ChatCompletionRequest, CHAT | extra)
    assert e.value.status == 400


@pytest.mark.parametrize("structured, expected", [
    (pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), StructuredOutput.json_schema(SCHEMA)),
    (pb.StructuredOutput(json_object=True), StructuredOutput.json_object()),
    (pb.StructuredOutput(regex="[a-z]+"), StructuredOutput.regex("[a-z]+")),
    (pb.StructuredOutput(choice=pb.Choices(choices=["x", "y"])), StructuredOutput.choice(["x", "y"])),
    (pb.StructuredOutput(grammar='start: "a"'), StructuredOutput.grammar('start: "a"')),
    (pb.StructuredOutput(), None),
])
def test_the_grpc_field_becomes_the_engines_constraint(facts, structured, expected):
    assert parse_request(build_request(prompt="hi", structured=structured), facts).params.structured == expected


@pytest.mark.parametrize("structured, message", [
    (pb.StructuredOutput(json_schema="{not json"), "not valid JSON"),
    (pb.StructuredOutput(json_schema=json.dumps({"type": "nonsense"})), "nonsense"),
    (pb.StructuredOutput(regex="(unclosed"), "unclosed group"),
    (pb.StructuredOutput(grammar="start: missing_rule"), "unknown name"),
    (pb.StructuredOutput(choice=pb.Choices()), "non-empty list"),
])
def test_a_constraint_the_compiler_rejects_is_invalid_argument_with_its_message(facts, structured, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        parse_request(build_request(prompt="hi", structured=structured), facts)
    assert e.value.code == "INVALID_ARGUMENT" and str(e.value).startswith("structured output: ")


def test_structured_output_with_ignore_eos_is_refused(facts):
    with pytest.raises(InvalidRequest, match="ignore_eos cannot be combined"):
        parse_request(build_request(prompt="hi", ignore_eos=True, structured=pb.StructuredOutput(regex="a")), facts)


@pytest.fixture(scope="module")
def server():
    s = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")])
    yield s
    s.close()


def test_the_openai_client_gets_a_400_with_the_compilers_message(server):
    client = server.client()
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="structured output: invalid json") as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}],
                                       response_format=bad_schema)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi",
                                  extra_body={"structured_outputs": {"regex": "(a"}})
    # and the server keeps serving
    assert client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2).choices[0].text
    # a constrained request cut by max_tokens (the mock replica does not constrain: its output ends by length)
    cut = client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2,
                                    extra_body={"structured_outputs": {"regex": "[a-z ]+"}})
    assert cut.choices[0].finish_reason == "length"
    text = httpx.get(f"{server.url}/metrics").text
    assert 'tandem_structured_output_requests_total{outcome="invalid"} 2.0' in text
    assert 'tandem_structured_output_requests_total{outcome="incomplete"} 1.0' in text
