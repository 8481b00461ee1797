"""The cases tests/cluster/test_api_fuzz.py sends: Hypothesis strategies, and draw(), which draws one part of
them (every draw derandomized: the same cases every run). No network here.

schema_cases: schemathesis cases from the HTTP API's own OpenAPI document, positive and negative. The rest is
what schema-driven generation rarely produces:
  http_raw: whole HTTP/1.1 requests (RawHttp) aimed at the OpenAI routes: invalid UTF-8 and NUL bytes, deep
      JSON, unknown fields, huge arrays, huge / negative / non-finite / wrong-typed numbers, truncated and
      oversized bodies, broken framing and authorization headers.
  grpc_message, grpc_raw: tests/cluster/fuzz_grpc.py.
"""
from __future__ import annotations

import json
from typing import Any

import schemathesis
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from tandem.router.auth import Authenticator
from tandem.router.driver_settings import DriverSettings
from tandem.router.http_service import build_app
from tandem.router.lifecycle import RequestDriver
from tandem.router.request_parsing import ModelFacts
from tandem.router.serving import Serving
from tests.cluster.fuzz_cases import MODEL, ROUTES, VOCAB, WORDS, RawHttp, examples
from tests.cluster.fuzz_grpc import grpc_message, grpc_raw

# -- HTTP --------------------------------------------------------------------------------------------------------

def request_bytes(path: str, body: bytes, key: str | None, *, method: str = "POST", headers: dict | None = None,
                  content_length: int | None = None) -> bytes:
    """An HTTP/1.1 request with Connection: close; content_length: the length declared (default: len(body))."""
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz", "Connection: close", "Content-Type: application/json",
             f"Content-Length: {len(body) if content_length is None else content_length}"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


@st.composite
def valid_body(draw, path: str) -> dict:
    """A body the server runs (in the test manifest's limits), to break one way."""
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, MODEL, ""])), "max_tokens": draw(st.integers(1, 4))}
    if path == ROUTES[0]:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(WORDS))}]
    else:
        body["prompt"] = draw(st.sampled_from(WORDS))
    if draw(st.booleans()):
        body["stream"] = True
    return body


def _dump(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


_INVALID_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82", b"\xfe\xfe"]
_NUMBERS = [b"1e400", b"-1e400", b"NaN", b"Infinity", b"-Infinity", b"-0.0", b"1e-320", b"-1", b"0", b"1.5",
            b"4.0", str(2**31).encode(), str(2**63).encode(), str(-2**63 - 1).encode(), b"1" * 5000, b"1" * 400,
            b'"1"', b"true", b"null", b"[]", b"{}", b"0x10", b"01", b"1e", b"--1", b".5"]
_FIELDS = ["max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "priority", "logprobs", "top_logprobs",
           "best_of", "timeout", "stop_token_ids", "stop", "prompt", "messages", "model", "stream", "user",
           "session_id", "stream_options", "ignore_eos"]


def _with_field(body: dict, field: str, raw_value: bytes) -> bytes:
    """body's JSON with field set to raw_value, spliced in as raw bytes (it may not be valid JSON)."""
    rest = _dump({k: v for k, v in body.items() if k != field})
    return rest[:-1] + (b", " if len(rest) > 2 else b"") + _dump(field) + b": " + raw_value + b"}"


@st.composite
def http_raw(draw, key: str, max_body_bytes: int) -> RawHttp:
    path = draw(st.sampled_from(ROUTES))
    body = draw(valid_body(path))
    text_field = "prompt" if path == ROUTES[1] else "messages"
    kind = draw(st.sampled_from(["invalid_utf8", "nul", "deep_json", "unknown_fields", "huge_array", "number",
                                 "truncated", "oversized", "framing", "authorization", "content_shape"]))

    def sent(raw: bytes, **kw) -> RawHttp:
        return RawHttp(kind, request_bytes(path, raw, key), **kw)

    if kind == "invalid_utf8":
        bad = draw(st.sampled_from(_INVALID_UTF8))
        target = draw(st.sampled_from(["text", "model", "key", "whole"]))
        if target == "whole":
            return sent(bad + _dump(body))
        raw = _dump(body)
        marker = {"text": b"\"content\": \"" if path == ROUTES[0] else b"\"prompt\": \"",
                  "model": b"\"model\": \"", "key": b"{\""}[target]
        i = raw.index(marker) + len(marker)
        return sent(raw[:i] + bad + raw[i:])
    if kind == "nul":
        field = draw(st.sampled_from(["text", "model", "stop", "session_id", "user", "raw"]))
        nul = "\x00" * draw(st.sampled_from([1, 2, 100, 3000]))
        if field == "raw":  # an unescaped control character: not JSON
            return sent(_dump(body).replace(b"\"model\": \"", b"\"model\": \"\x00"))
        if field == "text":
            if path == ROUTES[0]:
                body["messages"][0]["content"] = nul + body["messages"][0]["content"]
            else:
                body["prompt"] = body["prompt"] + nul
        else:
            body[field] = nul if field != "stop" else [nul]
        return sent(_dump(body))
    if kind == "deep_json":
        depth = draw(st.sampled_from([33, 100, 999, 1000, 1001, 5000, 100_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        nested = opener * depth + b"1" + closer * depth
        where = draw(st.sampled_from(["top", text_field, "stop", "unknown", "unclosed"]))
        if where == "top":
            return sent(nested)
        if where == "unclosed":
            return sent(_with_field(body, text_field, opener * depth))
        return sent(_with_field(body, where if where != "unknown" else "deep", nested))
    if kind == "unknown_fields":
        names = draw(st.lists(st.one_of(st.sampled_from(["__proto__", "", "tools", "logit_bias", "echo",
                                                         "response_format", "functions", "MODEL", "x" * 1000]),
                                        st.text(max_size=12)), min_size=1, max_size=4))
        values = st.one_of(st.none(), st.integers(), st.text(max_size=8), st.just({"type": "json_object"}),
                           st.just([{"type": "function"}]), st.just({"1": 100}), st.just(True))
        for name in names:
            body[name] = draw(values)
        return sent(_dump(body))
    if kind == "huge_array":
        count = draw(st.sampled_from([3, 100, 10_000, 60_000]))
        field, item = draw(st.sampled_from([
            ("prompt", "a"), ("prompt", [1, 2]), ("prompt", 7), ("stop", "x"), ("stop_token_ids", 5),
            ("messages", {"role": "user", "content": "hi"}), (text_field, [])]))
        if field == "messages" and path == ROUTES[1]:
            field = "prompt"
        body[field] = [item] * count
        if field == "stop_token_ids" or (field == "prompt" and item == 7):
            body[field] = list(range(count))
        return sent(_dump(body))
    if kind == "number":
        field = draw(st.sampled_from(_FIELDS))
        raw = draw(st.sampled_from(_NUMBERS))
        timeout = None
        if field == "timeout":
            try:
                timeout = float(json.loads(raw))
            except (ValueError, TypeError, OverflowError):
                timeout = None
        return RawHttp(kind, request_bytes(path, _with_field(body, field, raw), key), timeout_s=timeout)
    if kind == "truncated":
        raw = _dump(body)
        cut = draw(st.integers(0, len(raw) - 1))
        extra = draw(st.sampled_from([1, 100, 10_000]))
        data = request_bytes(path, raw[:cut], key, content_length=len(raw) + extra)
        return RawHttp(kind, data, close=draw(st.sampled_from(["half", "abort"])), api=False)
    if kind == "oversized":
        size = max_body_bytes + draw(st.sampled_from([1, 1000, max_body_bytes]))
        how = draw(st.sampled_from(["declared", "chunked", "lying"]))
        raw = b'{"model": "' + b"a" * size + b'"}'
        if how == "declared":
            return RawHttp(kind, request_bytes(path, raw, key), api=False)
        if how == "lying":  # declares more than the limit, sends a little
            return RawHttp(kind, request_bytes(path, b"{}", key, content_length=10**draw(st.integers(7, 30))),
                           close="half", api=False)
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(raw[i:i + 8192]), raw[i:i + 8192]) for i in range(0, len(raw), 8192))
        head = request_bytes(path, b"", key).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
        return RawHttp(kind, head + chunks + b"0\r\n\r\n", api=False)
    if kind == "framing":
        raw = _dump(body)
        variant = draw(st.sampled_from(["cl_text", "cl_negative", "cl_and_te", "bad_chunk", "get", "put",
                                        "unknown_path", "http10", "header_bytes", "no_host", "gzip", "lf_only"]))
        if variant == "cl_text":
            data = request_bytes(path, raw, key).replace(b"Content-Length: %d" % len(raw), b"Content-Length: abc")
        elif variant == "cl_negative":
            data = request_bytes(path, raw, key, content_length=-5)
        elif variant == "cl_and_te":
            data = request_bytes(path, raw, key, headers={"Transfer-Encoding": "chunked"})
        elif variant == "bad_chunk":
            head = request_bytes(path, b"", key).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
            data = head + b"zz\r\n" + raw + b"\r\n0\r\n\r\n"
        elif variant in ("get", "put"):
            data = request_bytes(path, raw, key, method=variant.upper())
        elif variant == "unknown_path":
            data = request_bytes(draw(st.sampled_from(["/v1/chat", "/v2/completions", "/%00", "/../etc/passwd",
                                                       "/v1/completions/" + "a" * 5000])), raw, key)
        elif variant == "http10":
            data = request_bytes(path, raw, key).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        elif variant == "header_bytes":
            data = request_bytes(path, raw, key, headers={"X-Fuzz": "a\x00b\xff"})
        elif variant == "no_host":
            data = request_bytes(path, raw, key).replace(b"Host: fuzz\r\n", b"")
        elif variant == "gzip":
            data = request_bytes(path, b"\x1f\x8b\x08\x00garbage", key, headers={"Content-Encoding": "gzip"})
        else:
            data = request_bytes(path, raw, key).replace(b"\r\n", b"\n")
        # cl_and_te: the body is read as chunked and holds no chunk, so the client ends it (the test holds a
        # stalled body open on purpose, once, apart from these).
        close = "half" if variant == "cl_and_te" else "read"
        return RawHttp(kind, data, close=close, api=variant in ("gzip", "http10"))
    if kind == "authorization":
        value = draw(st.sampled_from([None, "", "Bearer", "Bearer ", "Basic Zm9vOmJhcg==", f"bearer {key}",
                                      f"Bearer {key} extra", f"Bearer {key[:-1]}", "Bearer " + "k" * 8000,
                                      f"Bearer  {key}", "Bearer \xff\xfe", f"Bearer {key}\x00"]))
        head = request_bytes(path, _dump(body), None)
        if value is not None:
            head = head.replace(b"Connection: close", b"Connection: close\r\nAuthorization: "
                                + value.encode())
        return RawHttp(kind, head, api="\x00" not in value if value else True)
    # content_shape: content parts and prompts of the wrong shape
    if path == ROUTES[0]:
        body["messages"] = draw(st.sampled_from([
            [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}],
            [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [None, 1]}],
            [{"role": "user", "content": None}], [{"role": "assistant", "content": None}],
            [{"role": "🙂", "content": "hi"}], [{"role": "user"}], [{}], [1, "a"], "hi",
            [{"role": "user", "content": "hi", "tool_calls": [{"id": "x"}]}],
            [{"role": "system", "content": "s"}] * 3]))
    else:
        body["prompt"] = draw(st.sampled_from([[], [[]], [[1, -1]], [[2**31]], [1.0, 2.0], [True], ["a", 1],
                                               [[1], "a"], [VOCAB], [VOCAB - 1, 0], {"a": 1}, None]))
    return sent(_dump(body))


# -- drawing every case ------------------------------------------------------------------------------------------

def openapi_document(key: str) -> dict:
    """The document a router with API keys serves: build_app's, over a router with no replicas."""
    serving = Serving(RequestDriver([], [], DriverSettings()), ModelFacts(MODEL, None, VOCAB, 2048), "colocated",
                      auth=Authenticator({key: "fuzz"}))
    return build_app(serving).openapi()


def schema_request(case) -> RawHttp:
    """A schemathesis case as raw bytes; a 504 is an honest answer when its body asked for a `timeout`."""
    body = case.body
    if body is NOT_SET or body is None:
        body = b""
    elif isinstance(body, str):
        body = body.encode()
    elif not isinstance(body, bytes):
        body = json.dumps(body).encode()
    timeout = case.body.get("timeout") if isinstance(case.body, dict) else None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        timeout = None
    data = request_bytes(case.path, body, None, method=case.method.upper(), headers=dict(case.headers or {}))
    return RawHttp(f"schema_{case.meta.generation.mode.value}", data, timeout_s=timeout)


def _naming(pair):
    case, model = pair
    if model is not None and isinstance(case.body, dict):
        case.body["model"] = model
    return case


def schema_cases(document: dict, path: str, count: int, key: str) -> list[RawHttp]:
    """count cases of path's POST operation, half positive, half negative. Nine in ten carry the key (the rest
    schemathesis' own Authorization header, or none); a positive body names the served model three times in
    four (the schema cannot know the model's name)."""
    operation = schemathesis.openapi.from_dict(document)[path]["POST"]
    cases: list[RawHttp] = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        keyed = count // 2 - count // 20
        for headers, n in (({"Authorization": f"Bearer {key}"}, keyed), (None, count // 2 - keyed)):
            strategy = operation.as_strategy(generation_mode=mode, headers=headers)
            if mode == GenerationMode.POSITIVE:
                strategy = st.tuples(strategy, st.sampled_from([MODEL, MODEL, MODEL, None])).map(_naming)
            cases += [schema_request(c) for c in examples(strategy, n)]
    return cases


def get_cases(document: dict) -> list[RawHttp]:
    """What the GET operations yield: they take no input but the key, so a handful."""
    schema = schemathesis.openapi.from_dict(document)
    cases: list[RawHttp] = []
    for path in ("/health", "/metrics", "/v1/models"):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                cases += [schema_request(c) for c in examples(schema[path]["GET"].as_strategy(generation_mode=mode), 5)]
            except Unsatisfiable:  # an operation with no input has nothing to break
                pass
    return cases


# What draw() draws, cheapest first; the HTTP schema-driven cases are split over the two POST routes.
PARTS = ("grpc_raw", "http_raw", "grpc_message", "http_schema:/v1/completions", "http_schema:/v1/chat/completions")


def draw(part: str, count: int, key: str, max_body_bytes: int) -> list:
    """count cases of one of PARTS (the /v1/completions part adds the GET operations' few)."""
    if part.startswith("http_schema:"):
        path = part.split(":", 1)[1]
        document = openapi_document(key)
        return schema_cases(document, path, count, key) + (get_cases(document) if path == ROUTES[1] else [])
    if part == "http_raw":
        return examples(http_raw(key, max_body_bytes), count)
    if part == "grpc_message":
        return examples(grpc_message(), count)
    return examples(grpc_raw(), count)
