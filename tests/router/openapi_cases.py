"""Request bodies schemathesis builds from the HTTP API's OpenAPI document, for tests/router/test_openapi_schema.py:
`python -m tests.router.openapi_cases` prints {path: {"positive": [...], "negative": [...]}} as JSON, each body
either {"json": value} or {"raw": base64} (negative cases may be bytes that are no JSON at all).

It runs in its own interpreter: hypothesis builds and drops many small objects per example, and inside the long
suite's process (gigabytes of live objects by then) its garbage collections stalled this generation for minutes."""

from __future__ import annotations

import base64
import json

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tandem.router.auth import Authenticator
from tandem.router.http_service import build_app
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.replicas import MockDecode
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ModelFacts
from tandem.router.serving import Serving

PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_EXAMPLES = 100
EXAMPLES = settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
                    phases=[Phase.generate], suppress_health_check=list(HealthCheck))


def app_for(keys: dict[str, str] | None):
    driver = RequestDriver([], [Replica("decode-0", "decode", MockDecode("decode-0"))], DriverSettings())
    return build_app(Serving(driver, ModelFacts("m", None, 1000, 512), "colocated", auth=Authenticator(keys)))


def bodies(path: str, mode: GenerationMode) -> list[dict]:
    """Bodies for path's operation without API keys: the body is all that can break the schema."""
    operation = schemathesis.openapi.from_dict(app_for(None).openapi())[path]["POST"]
    found = []

    @EXAMPLES
    @given(operation.as_strategy(generation_mode=mode))
    def collect(case):
        body = case.body
        found.append({"raw": base64.b64encode(body).decode()} if isinstance(body, bytes) else {"json": body})

    collect()
    return found


if __name__ == "__main__":
    print(json.dumps({path: {mode.value: bodies(path, mode)
                             for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)} for path in PATHS}))
