"""The wire format: headers survive packing, checksums depend on payload and tag, and a receiver refuses a
header that does not fit its reservation or its share of the layers and KV heads."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.kv_transfer.rank_transfer import Inbound
from tandem.kv_transfer.wire import DataHeader, Kind, Status, checksum, make_tag, split_tag, transfer_key

PER = 2 * 16 * 64 * 4


def header(**changes) -> DataHeader:
    fields = dict(index=3, msgs_for_dst=4, src_rank=1, layers=range(2, 4), kv_heads=range(0, 2), blocks=range(0, 5),
                  payload_bytes=2 * 2 * 5 * PER, checksum=123, sender="127.0.0.1:5555")
    return DataHeader(**(fields | changes))


def test_header_and_tag_round_trip():
    h = header()
    assert DataHeader.unpack(h.pack() + b"payload") == h
    key = transfer_key("req-9/0")
    assert key < 1 << 48 and split_tag(make_tag(key, Kind.ACK, 7)) == (key, Kind.ACK, 7)
    with pytest.raises(ValueError, match="magic"):
        DataHeader.unpack(b"JUNK" + h.pack()[4:])
    with pytest.raises(ValueError, match="shorter"):
        DataHeader.unpack(h.pack()[:10])


def test_checksums_change_with_one_bit_and_with_the_tag():
    payload = np.random.default_rng(0).integers(0, 255, 1 << 16, dtype=np.uint8)
    flipped = payload.copy()
    flipped[4321] ^= 1
    assert checksum(payload, 5) != checksum(flipped, 5)
    assert checksum(payload, 5) != checksum(payload, 6)  # delivered under another tag: caught too


@pytest.mark.parametrize("bad, why", [
    (dict(index=2), "under tag index"),
    (dict(payload_bytes=100), "bytes for a slice"),
    (dict(layers=range(4, 6), payload_bytes=2 * 2 * 5 * PER), "this rank holds layers"),
    (dict(kv_heads=range(1, 3), payload_bytes=2 * 2 * 5 * PER), "this rank holds layers"),
    (dict(blocks=range(0, 9), payload_bytes=2 * 2 * 9 * PER), "reserved"),
    (dict(msgs_for_dst=5), "message count"),
])
def test_a_header_that_does_not_fit_is_refused(bad, why):
    inbound = Inbound("t", 0.0, block_ids=tuple(range(10, 17)), expected=4, arrived={0})
    fits = header()
    assert inbound.problem_with(fits, 3, fits.payload_bytes, range(0, 4), range(0, 2), PER) is None
    h = header(**bad)
    status, reason = inbound.problem_with(h, 3, 1 << 30, range(0, 4), range(0, 2), PER)
    assert status is Status.BAD_MESSAGE and why in reason


def test_a_message_that_arrives_twice_is_refused():
    inbound = Inbound("t", 0.0, block_ids=tuple(range(10, 17)), expected=4, arrived={3})
    h = header()
    assert "twice" in inbound.problem_with(h, 3, h.payload_bytes, range(0, 4), range(0, 2), PER)[1]
