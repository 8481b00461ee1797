"""The gRPC part of the API fuzz (tests/cluster/test_api_fuzz.py): tandem.v1 request messages built from the
proto's descriptors, each field plausible or extreme (grpc_message), and bytes that are no well-formed message
of the method's input type (grpc_raw: random, truncated, flipped, wrong wire types, overlong varints, invalid
UTF-8, nested groups). No network here."""
from __future__ import annotations

import math

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.request_parsing import CHAT_ROLES
from tests.cluster.fuzz_cases import MODEL, VOCAB, WORDS, RawGrpc

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
