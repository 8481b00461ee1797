"""OpenAI's error reply (router/openai_errors.py): the body a client of the HTTP API gets, and the HTTP status a
failed request's gRPC status becomes."""

from __future__ import annotations

import pytest

from tandem.router.openai_errors import OpenAIError, http_status_for


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
