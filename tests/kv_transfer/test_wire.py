"""The wire format: headers and status messages survive sealing and opening, a MAC depends on the secret, the
tag, every header byte and every payload byte, anything else that comes off the wire is refused as forged or
malformed (never another exception), and a receiver refuses an authentic header that does not fit its
reservation or its share of the layers and KV heads."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.rank_transfer import Inbound
from tandem.kv_transfer.wire import (HEADER_BYTES, MAC_BYTES, STATUS_BYTES, DataHeader, ForgedMessage, Kind,
                                     MalformedMessage, MessageKey, Status, StatusMessage, make_tag, split_tag,
                                     transfer_key)

PER = 2 * 16 * 64 * 4
KEY = MessageKey(b"k" * 32)
TAG = make_tag(transfer_key("req-9/0"), Kind.DATA, 3)


def header(**changes) -> DataHeader:
    fields = dict(index=3, msgs_for_dst=4, src_rank=1, layers=range(2, 4), kv_heads=range(0, 2), blocks=range(0, 5),
                  payload_bytes=2 * 2 * 5 * PER)
    return DataHeader(**(fields | changes))


def sealed(h: DataHeader, payload: np.ndarray, key: MessageKey = KEY, tag: int = TAG) -> np.ndarray:
    return np.concatenate([np.frombuffer(h.seal(key, tag, payload), dtype=np.uint8), payload])


def payload_for(h: DataHeader) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, h.payload_bytes, dtype=np.uint8)


def test_header_status_and_tag_round_trip():
    h = header()
    assert DataHeader.open(KEY, TAG, sealed(h, payload_for(h))) == h
    key = transfer_key("req-9/0")
    assert key < 1 << 48 and split_tag(make_tag(key, Kind.ACK, 7)) == (key, Kind.ACK, 7)
    tag = make_tag(key, Kind.ACK, 7)
    message = StatusMessage(Status.EXPIRED, 7, 123)
    raw = message.seal(KEY, tag)
    assert len(raw) == STATUS_BYTES and StatusMessage.open(KEY, tag, np.frombuffer(raw, dtype=np.uint8)) == message


def test_a_mac_fails_with_one_flipped_bit_anywhere_another_tag_or_another_secret():
    h = header()
    good = sealed(h, payload_for(h))
    for position in (0, 17, HEADER_BYTES - MAC_BYTES - 1, HEADER_BYTES - 1, HEADER_BYTES + 4321, len(good) - 1):
        flipped = good.copy()
        flipped[position] ^= 1
        with pytest.raises(ForgedMessage):
            DataHeader.open(KEY, TAG, flipped)
    with pytest.raises(ForgedMessage):  # delivered under another message's tag
        DataHeader.open(KEY, TAG + 1, good)
    with pytest.raises(ForgedMessage):
        DataHeader.open(MessageKey(b"another cluster's secret"), TAG, good)
    tag = make_tag(5, Kind.ABORT, 0)
    raw = StatusMessage(Status.ABORTED, 0).seal(KEY, tag)
    with pytest.raises(ForgedMessage):
        StatusMessage.open(KEY, make_tag(6, Kind.ABORT, 0), raw)  # another transfer's key


def test_what_is_not_one_of_our_messages_is_malformed():
    h = header()
    payload = payload_for(h)
    with pytest.raises(MalformedMessage, match="shorter"):
        DataHeader.open(KEY, TAG, sealed(h, payload)[:HEADER_BYTES - 1])
    with pytest.raises(MalformedMessage, match="payload bytes"):  # an authentic header naming other lengths
        DataHeader.open(KEY, TAG, sealed(header(payload_bytes=10), payload))
    for magic, dtype_code, why in ((b"JUNK", 0, "magic"), (b"TKV2", 0, "magic"), (b"TKV3", 9, "KV dtype code 9")):
        # authentic, but not this format (an older header, an unknown payload dtype)
        fields = struct.pack("<4sIIIIIIIIIQI4x", magic, 3, 4, 1, 2, 2, 0, 2, 0, 5, len(payload), dtype_code)
        with pytest.raises(MalformedMessage, match=why):
            DataHeader.open(KEY, TAG, np.frombuffer(fields + KEY.mac(TAG, fields, payload) + payload.tobytes(),
                                                    dtype=np.uint8))
    tag = make_tag(5, Kind.ACK, 2)
    for status, rank, why in ((9, 2, "unknown status code 9"), (1, 2, "unknown status code 1"),
                              (0, 3, "rank 3 under tag index 2")):
        body = struct.pack("<IIQ", status, rank, 0)
        with pytest.raises(MalformedMessage, match=why):
            StatusMessage.open(KEY, tag, body + KEY.mac(tag, body))
    with pytest.raises(MalformedMessage, match="expected"):
        StatusMessage.open(KEY, tag, StatusMessage(Status.OK, 2).seal(KEY, tag) + b"\0")


def test_secrets_are_checked_and_never_shown():
    with pytest.raises(ValueError, match="at least 16"):
        MessageKey(b"short")
    with pytest.raises(ValueError, match="at least 16") as caught:
        TransferConfig(secret=b"0123456789")
    assert "0123456789" not in str(caught.value)
    config = TransferConfig()
    assert len(config.secret) == 32 and config.secret != TransferConfig().secret  # random per config object
    assert repr(config.secret) not in repr(config) and "secret" not in repr(config)


@pytest.mark.parametrize("bad, why", [
    (dict(index=2), "under tag index"),
    (dict(payload_bytes=100), "bytes for a slice"),
    (dict(layers=range(4, 6), payload_bytes=2 * 2 * 5 * PER), "this rank holds layers"),
    (dict(kv_heads=range(1, 3), payload_bytes=2 * 2 * 5 * PER), "this rank holds layers"),
    (dict(blocks=range(0, 9), payload_bytes=2 * 2 * 9 * PER), "reserved"),
    (dict(blocks=range(2, 2), payload_bytes=0), "empty slice"),
    (dict(msgs_for_dst=5), "message count"),
])
def test_a_header_that_does_not_fit_is_refused(bad, why):
    inbound = Inbound("t", 0.0, block_ids=tuple(range(10, 17)), expected=4, arrived={0})
    assert inbound.problem_with(header(), 3, range(0, 4), range(0, 2), PER) is None
    status, reason = inbound.problem_with(header(**bad), 3, range(0, 4), range(0, 2), PER)
    assert status is Status.BAD_MESSAGE and why in reason


def test_a_message_that_arrives_twice_is_refused():
    inbound = Inbound("t", 0.0, block_ids=tuple(range(10, 17)), expected=4, arrived={3})
    assert "twice" in inbound.problem_with(header(), 3, range(0, 4), range(0, 2), PER)[1]
