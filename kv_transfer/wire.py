"""What travels between transfer agents: 64-bit tags, the data message header, acknowledgements, checksums.

Tag: bits 63..16 the transfer's key (48 bits of xxh64 of its id), bits 15..12 the kind, bits 11..0 an index
(a message's plan index for DATA, the destination rank for ACK, the source rank for ABORT). Agents probe by
kind with a mask, so a message for a transfer they do not know is still received (and answered), never stuck.

DATA = header + payload. The payload is [layers, K|V, blocks, KV heads, block_size, head_dim] in the KV dtype:
the slice a plan Message names. The header repeats the slice, says how many messages this destination rank
gets in all and where the sender listens, and carries the xxh3-64 checksum of the payload (seeded with the
tag, so a payload delivered under another tag fails too). ACK (receiver -> sender) and ABORT (sender ->
receiver) carry a status code.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

KEY_SHIFT = 16
KIND_SHIFT = 12
INDEX_MASK = (1 << KIND_SHIFT) - 1
KIND_MASK = 0xF << KIND_SHIFT


class Kind(enum.IntEnum):
    DATA = 1
    ACK = 2
    ABORT = 3


class Status(enum.IntEnum):
    """Why a side ended its part; OK only in an ACK of a complete, verified destination rank."""

    OK = 0
    CHECKSUM = 1
    ABORTED = 2
    EXPIRED = 3
    UNKNOWN = 4  # the receiver holds no reservation under this key (never made, or already forgotten)
    BAD_MESSAGE = 5


def transfer_key(transfer_id: str) -> int:
    return xxhash.xxh64_intdigest(transfer_id.encode()) >> 16


def make_tag(key: int, kind: Kind, index: int) -> int:
    return (key << KEY_SHIFT) | (int(kind) << KIND_SHIFT) | index


def split_tag(tag: int) -> tuple[int, Kind, int]:
    return tag >> KEY_SHIFT, Kind((tag >> KIND_SHIFT) & 0xF), tag & INDEX_MASK


def checksum(payload, tag: int) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=tag)


_HEADER = struct.Struct("<4sIIIIIIIIIQQ64s")
HEADER_BYTES = _HEADER.size
_MAGIC = b"TKV1"


@dataclass(frozen=True)
class DataHeader:
    """msgs_for_dst: how many DATA messages the destination rank receives for this transfer in all.
    Ranges are global layer / KV head indices and indices into the request's block table."""

    index: int
    msgs_for_dst: int
    src_rank: int
    layers: range
    kv_heads: range
    blocks: range
    payload_bytes: int
    checksum: int
    sender: str  # the sending agent's address, for the ACK

    def pack(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.index, self.msgs_for_dst, self.src_rank, self.layers.start,
                            len(self.layers), self.kv_heads.start, len(self.kv_heads), self.blocks.start,
                            len(self.blocks), self.payload_bytes, self.checksum, self.sender.encode())

    @classmethod
    def unpack(cls, raw) -> DataHeader:
        """Raises ValueError for a header that is not one of ours."""
        if len(raw) < HEADER_BYTES:
            raise ValueError(f"message of {len(raw)} bytes is shorter than a header")
        (magic, index, total, src, l0, nl, h0, nh, b0, nb, nbytes, digest,
         sender) = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        return cls(index, total, src, range(l0, l0 + nl), range(h0, h0 + nh), range(b0, b0 + nb), nbytes, digest,
                   sender.rstrip(b"\0").decode())


_STATUS = struct.Struct("<IIQ")  # status, rank, bytes


def pack_status(status: Status, rank: int, nbytes: int = 0) -> bytes:
    return _STATUS.pack(int(status), rank, nbytes)


def unpack_status(raw) -> tuple[Status, int, int]:
    status, rank, nbytes = _STATUS.unpack_from(raw)
    return Status(status), rank, nbytes


STATUS_BYTES = _STATUS.size
