"""What travels between transfer agents: 64-bit tags, the data message header, status messages (ACK, ABORT), and
the keyed MAC every message carries.

Tag: bits 63..16 the transfer's key (48 bits of xxh64 of its id), bits 15..12 the kind, bits 11..0 an index
(a message's plan index for DATA, the destination rank for ACK, the source rank for ABORT). Agents probe by
kind with a mask, so a message for a transfer they do not know is still taken off the wire, never stuck.

DATA = header + payload. The payload is [layers, K|V, blocks, KV heads, rows, head_dim] in the sender's KV dtype
(rows: block_size, and a quantized store's scale row): the slice a plan Message names. The header repeats the
slice, says how many messages this destination rank gets in all and which KV dtype the payload holds (a receiver
of another dtype converts it), and ends with the message's MAC. A DATA message by reference (magic TKR3, between
agents of one
host: kv_transfer/shm.py) carries an ShmRef, where the payload lies in the sender's shared staging, in place
of the payload; the MAC then covers the ref. ACK (receiver -> sender) and ABORT (sender -> receiver) are a
status code, the sending rank and the MAC. No message carries an address: an agent answers only the peers it
was told of when the transfer was set up (kv_transfer/agent.py).

MAC: keyed BLAKE3 (32 bytes) under a key derived from the cluster's secret (TransferConfig.secret), over the
tag (8 bytes, little-endian), then the message's bytes before the MAC, then (DATA) the payload. It guards
against forgery and corruption alike: a message whose MAC fails, or that was delivered under another tag, is
refused (ForgedMessage). A message too short to be ours, or one that authenticates but does not parse, is
refused as MalformedMessage. Nothing here raises anything else for bytes that came off the wire.
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass

import blake3
import xxhash

from tandem.kv_transfer.descriptor import KV_DTYPES

KEY_SHIFT = 16
KIND_SHIFT = 12
INDEX_MASK = (1 << KIND_SHIFT) - 1
KIND_MASK = 0xF << KIND_SHIFT
TAG_MASK = (1 << 64) - 1  # tags are 64-bit: a 48-bit transfer key, the kind, a 12-bit index
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_KDF_CONTEXT = "tandem kv_transfer 2026-11 message MAC"


class Kind(enum.IntEnum):
    DATA = 1
    ACK = 2
    ABORT = 3


# (tag, mask) pairs that together match every kind nibble but DATA, ACK and ABORT (0, 4-7, 8-15): what an agent
# drains as malformed so that nothing of another kind stays queued in the transport.
OTHER_KINDS = ((0x0 << KIND_SHIFT, 0xF << KIND_SHIFT), (0x4 << KIND_SHIFT, 0xC << KIND_SHIFT),
               (0x8 << KIND_SHIFT, 0x8 << KIND_SHIFT))


class Status(enum.IntEnum):
    """Why a side ended its part; OK only in an ACK of a complete, verified destination rank. (Code 1, the
    checksum mismatch of the first wire format, is no longer sent: a message that fails its MAC is dropped.)"""

    OK = 0
    ABORTED = 2
    EXPIRED = 3
    UNKNOWN = 4  # the receiver holds no reservation under this key (never made, or already forgotten)
    BAD_MESSAGE = 5


class MalformedMessage(ValueError):
    """Bytes that are not one of our messages: too short, the wrong length, or fields that do not parse."""


class ForgedMessage(ValueError):
    """A message whose MAC does not match: sent without the cluster's secret, corrupted, or moved to another tag."""


def transfer_key(transfer_id: str) -> int:
    return xxhash.xxh64_intdigest(transfer_id.encode()) >> 16


def make_tag(key: int, kind: Kind, index: int) -> int:
    return (key << KEY_SHIFT) | (int(kind) << KIND_SHIFT) | index


def split_tag(tag: int) -> tuple[int, Kind, int]:
    """Raises ValueError for a kind nibble that is not a Kind (agents only take DATA, ACK and ABORT tags)."""
    return tag >> KEY_SHIFT, Kind((tag >> KIND_SHIFT) & 0xF), tag & INDEX_MASK


class MessageKey:
    """The cluster's secret as the agents use it: a BLAKE3 key derived from it (so any secret of at least
    MIN_SECRET_BYTES works, and the key serves this purpose only). Raises ValueError for a shorter secret."""

    def __init__(self, secret: bytes):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the transfer secret has {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
        key = blake3.blake3(secret, derive_key_context=_KDF_CONTEXT).digest()
        self._keyed = blake3.blake3(key=key)

    def mac(self, tag: int, *parts) -> bytes:
        """The MAC of tag and parts (bytes-like, contiguous: numpy arrays are read in place)."""
        h = self._keyed.copy()
        h.update(tag.to_bytes(8, "little"))
        for part in parts:
            h.update(part)
        return h.digest(MAC_BYTES)

    def check(self, expected: bytes, tag: int, *parts) -> None:
        """Raises ForgedMessage unless expected is the MAC of tag and parts (compared in constant time)."""
        if not hmac.compare_digest(bytes(expected), self.mac(tag, *parts)):
            raise ForgedMessage(f"MAC mismatch under tag {tag:#x}")


_FIELDS = struct.Struct("<4sIIIIIIIIIQI4x")  # 8-byte multiple: a payload after it is aligned
_MAGIC = b"TKV3"
_MAGIC_REF = b"TKR3"
HEADER_BYTES = _FIELDS.size + MAC_BYTES
_REF = struct.Struct("<II16sQQQQQQ")  # pid, fd, nonce, offset, length, stamp, layer / K|V / block strides


@dataclass(frozen=True)
class ShmRef:
    """Where a DATA message's payload lies on the sender's host, in the memfd the sending process `pid` holds as
    `fd`, whose segment starts with `nonce` (kv_transfer/shm.py). Either a staging slot: bytes offset..offset+
    length, and `stamp` is what the 8 bytes before them hold while the slot is this message's; or (strides not
    all 0) the sender's KV store itself: the slice starts at offset, and its layers, K|V halves and blocks lie
    `strides` bytes apart (KV heads x block_size x head_dim contiguous inside), no stamp."""

    pid: int
    fd: int
    nonce: bytes
    offset: int
    length: int
    stamp: int
    strides: tuple[int, int, int] = (0, 0, 0)

    @property
    def in_store(self) -> bool:
        return any(self.strides)

    def pack(self) -> bytes:
        return _REF.pack(self.pid, self.fd, self.nonce, self.offset, self.length, self.stamp, *self.strides)

    @classmethod
    def unpack(cls, raw) -> ShmRef:
        """Raises MalformedMessage for bytes that are not one packed ref."""
        if len(raw) != _REF.size:
            raise MalformedMessage(f"a ref of {len(raw)} bytes (expected {_REF.size})")
        pid, fd, nonce, offset, length, stamp, *strides = _REF.unpack(bytes(raw))
        return cls(pid, fd, nonce, offset, length, stamp, tuple(strides))


REF_BYTES = _REF.size


@dataclass(frozen=True)
class DataHeader:
    """msgs_for_dst: how many DATA messages the destination rank receives for this transfer in all.
    Ranges are global layer / KV head indices and indices into the request's block table. ref: where the
    payload lies when the message carries it by reference (payload_bytes is then its length there)."""

    index: int
    msgs_for_dst: int
    src_rank: int
    layers: range
    kv_heads: range
    blocks: range
    payload_bytes: int
    ref: ShmRef | None = None
    kv_dtype: str = "float32"  # the sender's KV store dtype (descriptor.KV_DTYPES): what the payload holds

    def seal(self, key: MessageKey, tag: int, payload) -> bytes:
        """The header's HEADER_BYTES (its fields, then the MAC of tag, fields and payload: the packed ref for a
        header with one, which then follows the header on the wire)."""
        if self.ref is not None:
            payload = self.ref.pack()
            if self.ref.length != self.payload_bytes:
                raise ValueError(f"a ref to {self.ref.length} bytes for a payload of {self.payload_bytes}")
        magic = _MAGIC if self.ref is None else _MAGIC_REF
        fields = _FIELDS.pack(magic, self.index, self.msgs_for_dst, self.src_rank, self.layers.start,
                              len(self.layers), self.kv_heads.start, len(self.kv_heads), self.blocks.start,
                              len(self.blocks), self.payload_bytes, KV_DTYPES.index(self.kv_dtype))
        return fields + key.mac(tag, fields, payload)

    @classmethod
    def open(cls, key: MessageKey, tag: int, message) -> DataHeader:
        """The header of a whole DATA message (header + payload, uint8) received under tag, once its MAC is
        checked. Raises MalformedMessage or ForgedMessage (see the module docstring)."""
        if len(message) < HEADER_BYTES:
            raise MalformedMessage(f"a DATA message of {len(message)} bytes is shorter than a header")
        fields = message[:_FIELDS.size]
        key.check(message[_FIELDS.size:HEADER_BYTES], tag, fields, message[HEADER_BYTES:])
        magic, index, total, src, l0, nl, h0, nh, b0, nb, nbytes, dtype = _FIELDS.unpack(bytes(fields))
        if dtype >= len(KV_DTYPES):
            raise MalformedMessage(f"unknown KV dtype code {dtype}")
        ref = None
        if magic == _MAGIC_REF:
            ref = ShmRef.unpack(message[HEADER_BYTES:])
            if ref.length != nbytes:
                raise MalformedMessage(f"the header names {nbytes} payload bytes, its ref {ref.length}")
        elif magic != _MAGIC:
            raise MalformedMessage(f"bad magic {magic!r}")
        elif nbytes != len(message) - HEADER_BYTES:
            raise MalformedMessage(f"the header names {nbytes} payload bytes, {len(message) - HEADER_BYTES} came")
        return cls(index, total, src, range(l0, l0 + nl), range(h0, h0 + nh), range(b0, b0 + nb), nbytes, ref,
                   KV_DTYPES[dtype])


_STATUS = struct.Struct("<IIQ")  # status, rank, bytes
STATUS_BYTES = _STATUS.size + MAC_BYTES


@dataclass(frozen=True)
class StatusMessage:
    """An ACK or ABORT: the status code and the rank that sent it (ACK: a destination rank, ABORT: a source
    rank; the tag's index says the same)."""

    status: Status
    rank: int
    nbytes: int = 0

    def seal(self, key: MessageKey, tag: int) -> bytes:
        """The message's STATUS_BYTES (its fields, then the MAC of tag and fields)."""
        fields = _STATUS.pack(int(self.status), self.rank, self.nbytes)
        return fields + key.mac(tag, fields)

    @classmethod
    def open(cls, key: MessageKey, tag: int, raw) -> StatusMessage:
        """Raises MalformedMessage (wrong length, unknown status code, a rank the tag does not name) or
        ForgedMessage."""
        if len(raw) != STATUS_BYTES:
            raise MalformedMessage(f"a status message of {len(raw)} bytes (expected {STATUS_BYTES})")
        fields = raw[:_STATUS.size]
        key.check(raw[_STATUS.size:], tag, fields)
        status, rank, nbytes = _STATUS.unpack(bytes(fields))
        if status not in Status._value2member_map_:
            raise MalformedMessage(f"unknown status code {status}")
        if rank != tag & INDEX_MASK:
            raise MalformedMessage(f"a status message from rank {rank} under tag index {tag & INDEX_MASK}")
        return cls(Status(status), rank, nbytes)
