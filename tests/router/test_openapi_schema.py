"""The HTTP API's OpenAPI document (router/http_service.py build_app): valid OpenAPI 3.1, served at /openapi.json
without a key, naming both request bodies, and the real contract of the body parser: every body the schema
allows is accepted by openai_bodies.parse_body (but for the cross-field rules a JSON schema cannot state), and
every body schemathesis builds to break the schema is refused. tests/cluster/test_api_fuzz.py fuzzes a running
cluster from the same document."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tandem.router.auth import Authenticator
from tandem.router.http_service import build_app
from tandem.router.lifecycle import DriverSettings, Replica, RequestDriver
from tandem.router.mock_replicas import MockDecode
from tandem.router.openai_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from tandem.router.openai_errors import OpenAIError
from tandem.router.request_parsing import ModelFacts
from tandem.router.serving import Serving

BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
# What the body parser refuses although the schema allows it: rules that tie two fields together.
CROSS_FIELD = ("stream_options", "top_logprobs", "best_of")
EXAMPLES = settings(max_examples=100, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))


def app_for(keys: dict[str, str] | None):
    driver = RequestDriver([], [Replica("decode-0", "decode", MockDecode("decode-0"))], DriverSettings())
    return build_app(Serving(driver, ModelFacts("m", None, 1000, 512), "colocated", auth=Authenticator(keys)))


@pytest.fixture(scope="module")
def document() -> dict:
    return app_for({"sk-acme-0123456789": "acme"}).openapi()


def test_the_document_is_valid_openapi_and_names_both_bodies(document):
    schemathesis.openapi.from_dict(document).validate()  # against the OpenAPI 3.1 meta-schema
    schemas = document["components"]["schemas"]
    for path, body in BODIES.items():
        operation = document["paths"][path]["post"]
        assert operation["requestBody"]["required"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{body.__name__}"
        assert operation["security"] == [{"bearer": []}]
    for name, schema in schemas.items():
        jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schemas["ChatCompletionRequest"]["required"]) == {"model", "messages"}
    assert set(schemas["CompletionRequest"]["required"]) == {"model", "prompt"}
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is False  # unknown fields are refused
    assert "anyOf" in schemas["CompletionRequest"]["properties"]["prompt"]  # the hand-validated shapes


def test_it_is_served_without_a_key_and_states_keys_only_when_they_are_on():
    with TestClient(app_for({"sk-acme-0123456789": "acme"})) as client:
        served = client.get("/openapi.json")
        assert served.status_code == 200
        assert served.json()["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert client.get("/v1/models").status_code == 401  # the routes themselves still need a key
    open_document = app_for(None).openapi()
    assert "securitySchemes" not in open_document["components"]
    assert all("security" not in op for ops in open_document["paths"].values() for op in ops.values())


def _cases(path: str, mode: GenerationMode) -> list:
    """Cases for path's operation without API keys: the body is all that can break the schema."""
    operation = schemathesis.openapi.from_dict(app_for(None).openapi())[path]["POST"]
    cases = []

    @EXAMPLES
    @given(operation.as_strategy(generation_mode=mode))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def _at(body, param: str):
    """The value at an OpenAIError's param ("messages[1].content") in body."""
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", param):
        body = body[int(index)] if index else body[name]
    return body


def _integral_float(value) -> bool:
    if isinstance(value, list):
        return any(_integral_float(v) for v in value)
    return isinstance(value, float) and value.is_integer()


@pytest.mark.parametrize("path", BODIES)
def test_every_body_the_schema_allows_is_accepted(path):
    for case in _cases(path, GenerationMode.POSITIVE):
        try:
            parse_body(BODIES[path], json.dumps(case.body).encode())
        except OpenAIError as e:
            if e.param in CROSS_FIELD or "null only in assistant" in e.message:  # content, by the role
                continue
            # JSON Schema counts 16.0 as an integer; the parser is strict and takes only 16.
            assert e.param is not None and _integral_float(_at(case.body, e.param)), (case.body, e.message)


@pytest.mark.parametrize("path", BODIES)
def test_every_body_the_schema_refuses_is_refused(path):
    refused = 0
    for case in _cases(path, GenerationMode.NEGATIVE):
        raw = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
        with pytest.raises(OpenAIError) as caught:
            parse_body(BODIES[path], raw)
        assert caught.value.status == 400
        refused += 1
    assert refused >= EXAMPLES.max_examples // 2  # not vacuous
