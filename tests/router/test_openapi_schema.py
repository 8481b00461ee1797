"""The HTTP API's OpenAPI document (router/http_service.py build_app): valid OpenAPI 3.1, served at /openapi.json
without a key, naming both request bodies, and the real contract of the body parser: every body the schema
allows is accepted by openai_bodies.parse_body (but for the cross-field rules a JSON schema cannot state), and
every body schemathesis builds to break the schema is refused. tests/cluster/test_api_fuzz.py fuzzes a running
cluster from the same document."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import schemathesis
from fastapi.testclient import TestClient

from tandem.router.openai_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from tandem.router.openai_errors import OpenAIError
from tests.router.openapi_cases import MAX_EXAMPLES, app_for

BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
# What the body parser refuses although the schema allows it: rules that tie two fields together.
CROSS_FIELD = ("stream_options", "top_logprobs", "best_of")
REPO = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="module")
def cases() -> dict:
    """{path: {"positive" | "negative": [body, ...]}}, built in a fresh interpreter (tests/router/openapi_cases.py
    says why); a body is JSON-ready data, or bytes."""
    done = subprocess.run([sys.executable, "-m", "tests.router.openapi_cases"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    built = json.loads(done.stdout.splitlines()[-1])
    return {path: {mode: [base64.b64decode(b["raw"]) if "raw" in b else b["json"] for b in found]
                   for mode, found in modes.items()} for path, modes in built.items()}


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
def test_every_body_the_schema_allows_is_accepted(path, cases):
    assert cases[path]["positive"]
    for body in cases[path]["positive"]:
        try:
            parse_body(BODIES[path], json.dumps(body).encode())
        except OpenAIError as e:
            if e.param in CROSS_FIELD or "null only in assistant" in e.message:  # content, by the role
                continue
            # JSON Schema counts 16.0 as an integer; the parser is strict and takes only 16.
            assert e.param is not None and _integral_float(_at(body, e.param)), (body, e.message)


@pytest.mark.parametrize("path", BODIES)
def test_every_body_the_schema_refuses_is_refused(path, cases):
    refused = 0
    for body in cases[path]["negative"]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        with pytest.raises(OpenAIError) as caught:
            parse_body(BODIES[path], raw)
        assert caught.value.status == 400
        refused += 1
    assert refused >= MAX_EXAMPLES // 2  # not vacuous
