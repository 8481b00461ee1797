"""The cases tests/cluster/test_api_fuzz.py sends: Hypothesis strategies, and draw(), which draws one part of
them (every draw derandomized: the same cases every run). No network here.

schema_cases: schemathesis cases from the HTTP API's own OpenAPI document, positive and negative. The rest is
what schema-driven generation rarely produces:
  http_raw: whole HTTP/1.1 requests (RawHttp) aimed at the OpenAI routes: invalid UTF-8 and NUL bytes, deep
      JSON, unknown fields, huge arrays, huge / negative / non-finite / wrong-typed numbers, truncated and
      oversized bodies, broken framing and authorization headers.
  grpc_message: tandem.v1 request messages built from the proto's descriptors, each field plausible or extreme.
  grpc_raw: bytes that are no well-formed message of the method's input type (random, truncated, flipped,
      wrong wire types, overlong varints, invalid UTF-8, nested groups).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import schemathesis
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.auth import Authenticator
from tandem.router.http_service import build_app
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.request_parsing import CHAT_ROLES, ModelFacts
from tandem.router.serving import Serving

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
ROUTES = ("/v1/chat/completions", "/v1/completions")
WORDS = ["Hello", "the sea", "What is 2+2?", "Name a color.", "Once upon a time", "héllo wörld", "日本語", "🙂"]


@dataclass(frozen=True)
class RawHttp:
    """One raw request. close: "read" (read the reply to EOF), "half" (shut our side after sending, then read:
    a body cut short) or "abort" (reset the connection after sending; no reply). api: it reaches an OpenAI
    route with well-formed framing, so a 4xx must carry OpenAI's error object. timeout_s: the `timeout` the
    body asks for (a 504 is then the answer it asked for), if any."""

    kind: str
    data: bytes
    close: str = "read"
    api: bool = True
    timeout_s: float | None = None


@dataclass(frozen=True)
class RawGrpc:
    kind: str
    method: str
    data: bytes


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


# -- gRPC messages, from the proto's descriptors ------------------------------------------------------------------

_INT_BOUNDS = {FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
               FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1)}
_STRINGS = ["", "\x00", "\x00" * 64, "\ufffd", "a" * 5000, "🙂" * 1000, " ", "#", "/", "a/b", "\u202e", "x" * 129]


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    """A value of field's type, plausible or extreme (within what the type can carry)."""
    if field.type in _INT_BOUNDS:
        lo, hi = _INT_BOUNDS[field.type]
        extremes = [v for v in (lo, -1, 0, 1, hi, hi // 2, 4096, 1 << 20) if lo <= v <= hi]
        return st.one_of(st.integers(0, 8), st.sampled_from(extremes), st.integers(lo, hi))
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.floats(0, 2), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308,
                                                           5e-324, 1e-300, -1.0]), st.floats())
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.sampled_from(_STRINGS))
    raise TypeError(f"no strategy for {field.full_name} (type {field.type})")


def _overrides() -> dict[str, st.SearchStrategy]:
    """Fields whose valid values are few: plausible ones first, then what the type allows."""
    return {
        "tandem.v1.GenerateRequest.model": st.sampled_from(["", MODEL, "gpt-4", MODEL + "\x00"]),
        "tandem.v1.GenerateRequest.text": st.one_of(st.sampled_from(WORDS), st.text(max_size=200),
                                                    st.sampled_from(_STRINGS)),
        "tandem.v1.TokenIds.ids": st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
                                            st.lists(st.integers(-2**31, 2**31 - 1), max_size=8),
                                            st.sampled_from([[VOCAB], [-1], [0] * 129, list(range(20_000))])),
        "tandem.v1.ChatMessage.role": st.one_of(st.sampled_from(sorted(CHAT_ROLES)), st.text(max_size=8)),
        "tandem.v1.ChatMessage.content": st.one_of(st.sampled_from(WORDS), st.sampled_from(_STRINGS)),
        "tandem.v1.SamplingParams.max_tokens": st.one_of(st.integers(1, 4), _scalar(
            pb.SamplingParams.DESCRIPTOR.fields_by_name["max_tokens"])),
        "tandem.v1.SamplingParams.stop_token_ids": st.one_of(
            st.lists(st.integers(0, VOCAB - 1), max_size=4), st.lists(st.integers(-2**31, 2**31 - 1), max_size=4),
            st.sampled_from([list(range(65)), [0] * 70_000])),
        "tandem.v1.SamplingParams.stop": st.one_of(st.lists(st.sampled_from(WORDS), max_size=3),
                                                   st.lists(st.sampled_from(_STRINGS), max_size=20)),
    }


def message(descriptor: Descriptor, overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
    """Messages of descriptor's type: every field absent or set (one member of a oneof at most), repeated
    fields short or huge, nested messages recursively."""
    overrides = _overrides() if overrides is None else overrides
    cls = pb.__dict__[descriptor.name]
    oneof_members = {f.name for o in descriptor.oneofs if not o.name.startswith("_") for f in o.fields}
    fields = {}
    for field in descriptor.fields:
        if field.full_name in overrides:
            value = overrides[field.full_name]
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            value = message(field.message_type, overrides)
        else:
            value = _scalar(field)
        repeated = field.is_repeated and field.full_name not in overrides
        fields[field.name] = st.lists(value, max_size=4) if repeated else value
    plain = {name: s for name, s in fields.items() if name not in oneof_members}
    chosen = st.one_of(st.none(), *(st.tuples(st.just(n), fields[n]) for n in sorted(oneof_members))) \
        if oneof_members else st.none()

    def build(values: dict, member) -> Message:
        if member is not None:
            values = values | {member[0]: member[1]}
        return cls(**values)

    return st.builds(build, st.fixed_dictionaries({}, optional=plain), chosen)


def grpc_message() -> st.SearchStrategy[tuple[str, Message]]:
    """(method, request): mostly Generate, some Abort and ListModels."""
    return st.one_of(
        st.tuples(st.just("Generate"), message(pb.GenerateRequest.DESCRIPTOR)),
        st.tuples(st.just("Generate"), message(pb.GenerateRequest.DESCRIPTOR)),
        st.tuples(st.just("Generate"), message(pb.GenerateRequest.DESCRIPTOR)),
        st.tuples(st.just("Abort"), message(pb.AbortRequest.DESCRIPTOR)),
        st.tuples(st.just("ListModels"), message(pb.ListModelsRequest.DESCRIPTOR)))


# -- gRPC raw bytes ------------------------------------------------------------------------------------------------

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


_PAYLOAD = {0: varint(2**63), 1: b"\x00" * 8, 2: varint(3) + b"abc", 5: b"\xff" * 4, 3: b"", 4: b"", 6: b"", 7: b""}


def grpc_raw() -> st.SearchStrategy[RawGrpc]:
    return _raw(message(pb.GenerateRequest.DESCRIPTOR))


@st.composite
def _raw(draw, messages: st.SearchStrategy[Message]) -> RawGrpc:
    method = draw(st.sampled_from(["Generate"] * 6 + ["Abort", "ListModels"]))
    valid = draw(messages).SerializeToString()
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "wire_type", "varint", "invalid_utf8",
                                 "unknown_fields", "groups", "empty"]))
    if kind == "random":
        data = draw(st.binary(max_size=256))
    elif kind == "truncated":
        data = valid[:draw(st.integers(0, max(0, len(valid) - 1)))] if valid else b"\x1a\x05ab"
    elif kind == "flipped":
        data = bytearray(valid or b"\x1a\x02hi")
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
        data = bytes(data)
    elif kind == "wire_type":
        field = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]))
        wire = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]))
        data = valid + tag(field, wire) + _PAYLOAD[wire]
    elif kind == "varint":
        data = draw(st.sampled_from([
            b"\x1a" + b"\xff" * 10 + b"\x01", b"\x1a" + varint(2**63) + b"abc", b"\x1a" + varint(1000) + b"short",
            b"\x38" + b"\xff" * 11, b"\x32" + varint(2**31) + b"\x08\x01", b"\x00\x00", b"\x80", tag(0, 0) + b"\x01",
            b"\x22\x04\x0a\x02\xff\xff", b"\x22\x03\x0a\x05\x01"]))
    elif kind == "invalid_utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x80abc"]))
        where = draw(st.sampled_from([1, 2, 3, 8]))
        data = valid + tag(where, 2) + varint(len(bad)) + bad
        if draw(st.booleans()):  # inside a chat message's role
            inner = tag(1, 2) + varint(len(bad)) + bad
            msg = tag(1, 2) + varint(len(inner)) + inner
            data = tag(5, 2) + varint(len(msg)) + msg
    elif kind == "unknown_fields":
        field = draw(st.sampled_from([9, 100, 1000, 2**29 - 1]))
        data = valid + tag(field, 2) + varint(100_000) + b"x" * 100_000
    elif kind == "groups":
        depth = draw(st.sampled_from([10, 100, 101, 1000, 50_000]))
        data = valid + tag(15, 3) * depth + tag(15, 4) * depth
    else:
        data = b""
    return RawGrpc(kind, method, data)


# -- drawing every case ------------------------------------------------------------------------------------------

def examples(strategy: st.SearchStrategy, count: int) -> list:
    """count values of strategy (fewer only if it has fewer), the same ones every run."""
    out: list = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value):
        out.append(value)

    collect()
    return out


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
