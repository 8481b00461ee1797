"""The disk tier's files: one KV block (all its layers, K and V, any scale rows) per file, named by its block hash,
checked on every read. Plain Python over bytes; the tier's storage turns a block's tensor into these bytes and back.

A file is a 48-byte header then the payload:
  magic b"TKVD", version (u16), reserved (u16), block hash (u64), payload bytes (u64), the 16-byte BLAKE2b-128
  digest of (block hash, payload), 8 zero bytes.
A read gives the payload only when the file is all there, names the block asked for, has the size the reader
expects and its checksum matches: a missing, truncated or corrupt file is a miss with its reason (the block is
recomputed and the reason counted), never served. Writes go to a temporary name and are renamed into place, so a
reader never sees half a file; a write that fails (a full disk, an I/O error) raises DiskTierError and leaves
nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"TKVD"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQ16s8x")
HEADER_BYTES = _HEADER.size  # 48


class DiskTierError(OSError):
    """A block could not be written to the disk tier (its message says why: no space, permissions, I/O)."""


@dataclass(frozen=True)
class BlockRead:
    """What reading a block's file found: payload (None on a miss) and, on a miss, why ("missing", "truncated",
    "corrupt", "wrong block", "wrong size", "unreadable")."""

    payload: bytes | None
    problem: str | None = None


def block_path(folder: Path, block_hash: int) -> Path:
    return folder / f"{block_hash:016x}.kv"


def _digest(block_hash: int, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(block_hash.to_bytes(8, "little"))
    h.update(payload)
    return h.digest()


def write_block(folder: Path, block_hash: int, payload: bytes | memoryview) -> int:
    """Writes the block's file (replacing any) and returns the bytes written. Raises DiskTierError, leaving no
    file behind, when it cannot be written."""
    path = block_path(folder, block_hash)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    header = _HEADER.pack(MAGIC, VERSION, 0, block_hash, len(payload), _digest(block_hash, payload))
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DiskTierError(e.errno, f"cannot write KV block {block_hash:#x} to {folder}: {e.strerror or e}") from e
    return HEADER_BYTES + len(payload)


def read_block(folder: Path, block_hash: int, expected_bytes: int) -> BlockRead:
    """The payload of the block's file if it is whole, names this block, holds expected_bytes and its checksum
    matches; else a miss saying why (see BlockRead)."""
    try:
        data = block_path(folder, block_hash).read_bytes()
    except FileNotFoundError:
        return BlockRead(None, "missing")
    except OSError:
        return BlockRead(None, "unreadable")
    if len(data) < HEADER_BYTES:
        return BlockRead(None, "truncated")
    magic, version, _, found_hash, size, digest = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        return BlockRead(None, "corrupt")
    if found_hash != block_hash:
        return BlockRead(None, "wrong block")
    if size != expected_bytes:
        return BlockRead(None, "wrong size")
    payload = memoryview(data)[HEADER_BYTES:]
    if len(payload) != size:
        return BlockRead(None, "truncated")
    if _digest(block_hash, payload) != digest:
        return BlockRead(None, "corrupt")
    return BlockRead(bytes(payload))


def remove_block(folder: Path, block_hash: int) -> None:
    """Deletes the block's file if it is there."""
    block_path(folder, block_hash).unlink(missing_ok=True)
