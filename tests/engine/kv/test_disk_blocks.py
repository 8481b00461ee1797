"""The disk tier's block files (engine/kv/disk_blocks.py): a block written is read back byte for byte; a missing,
truncated, corrupt, renamed or resized file is a miss with its reason, never served; a write that fails raises
DiskTierError and leaves no file behind."""

from __future__ import annotations

import errno
import os

import pytest

from tandem.engine.kv.disk_blocks import (HEADER_BYTES, BlockRead, DiskTierError, block_path, read_block,
                                          remove_block, write_block)

PAYLOAD = bytes(range(256)) * 40


def test_a_block_reads_back_as_written(tmp_path):
    assert write_block(tmp_path, 0xABCDEF, PAYLOAD) == HEADER_BYTES + len(PAYLOAD)
    found = read_block(tmp_path, 0xABCDEF, len(PAYLOAD))
    assert found.payload == PAYLOAD and found.problem is None
    write_block(tmp_path, 0xABCDEF, PAYLOAD[::-1])  # replaced in place
    assert read_block(tmp_path, 0xABCDEF, len(PAYLOAD)).payload == PAYLOAD[::-1]
    remove_block(tmp_path, 0xABCDEF)
    assert read_block(tmp_path, 0xABCDEF, len(PAYLOAD)).problem == "missing"
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda data: data[:HEADER_BYTES - 1], "truncated"),
    (lambda data: data[:-1], "truncated"),
    (lambda data: data[:-7] + bytes(7), "corrupt"),
    (lambda data: data[:HEADER_BYTES + 3] + bytes([data[HEADER_BYTES + 3] ^ 1]) + data[HEADER_BYTES + 4:], "corrupt"),
    (lambda data: b"JUNK" + data[4:], "corrupt"),
], ids=["header-cut", "payload-cut", "zeroed-tail", "one-bit", "bad-magic"])
def test_a_damaged_file_is_a_miss_with_its_reason(tmp_path, damage, problem):
    write_block(tmp_path, 7, PAYLOAD)
    path = block_path(tmp_path, 7)
    path.write_bytes(damage(path.read_bytes()))
    assert read_block(tmp_path, 7, len(PAYLOAD)) == BlockRead(None, problem)


def test_a_file_of_another_block_or_size_is_not_served(tmp_path):
    write_block(tmp_path, 7, PAYLOAD)
    os.replace(block_path(tmp_path, 7), block_path(tmp_path, 8))
    assert read_block(tmp_path, 8, len(PAYLOAD)).problem == "wrong block"
    write_block(tmp_path, 9, PAYLOAD)
    assert read_block(tmp_path, 9, len(PAYLOAD) + 16).problem == "wrong size"


def test_a_failed_write_raises_and_leaves_nothing(tmp_path, monkeypatch):
    real_open = open

    class FullDisk:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            if len(data) > HEADER_BYTES:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

    monkeypatch.setattr("builtins.open", FullDisk)
    with pytest.raises(DiskTierError, match="No space left on device") as info:
        write_block(tmp_path, 5, PAYLOAD)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    assert read_block(tmp_path, 5, len(PAYLOAD)).problem == "missing"
