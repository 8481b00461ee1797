"""OpenAI's error reply: OpenAIError (an HTTP status and OpenAI's error object), raised by the body parsing and
request translation of the HTTP API, and http_status_for, which maps a failed request's gRPC status name onto the
HTTP status and error type OpenAI's clients expect."""

from __future__ import annotations


class OpenAIError(Exception):
    """An error reply: HTTP `status` and, from body(), OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        """headers: extra reply headers (Retry-After on a 429)."""
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_HTTP_FOR_GRPC = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"), "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"), "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"), "NOT_FOUND": (404, "invalid_request_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"), "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "request_cancelled"), "UNIMPLEMENTED": (501, "not_implemented_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"), "DEADLINE_EXCEEDED": (504, "timeout_error"),
}


def http_status_for(grpc_code_name: str) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for a gRPC status name such as "NOT_FOUND":

    INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE -> 400 invalid_request_error
    UNAUTHENTICATED -> 401 authentication_error      PERMISSION_DENIED -> 403 permission_error
    NOT_FOUND -> 404 invalid_request_error           ALREADY_EXISTS -> 409 invalid_request_error
    RESOURCE_EXHAUSTED -> 429 rate_limit_error       CANCELLED -> 499 request_cancelled
    UNIMPLEMENTED -> 501 not_implemented_error       UNAVAILABLE -> 503 service_unavailable_error
    DEADLINE_EXCEEDED -> 504 timeout_error           INTERNAL and any other name -> 500 internal_error
    """
    return _HTTP_FOR_GRPC.get(grpc_code_name, (500, "internal_error"))
