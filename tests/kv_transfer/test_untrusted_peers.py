"""Transfer agents do not trust their peers. Hostile messages (random bytes, truncated, forged under another
secret, with a flipped MAC or another tag's MAC, unknown kinds and status codes, oversized lengths, transfers
nobody reserved) are sent at a live agent while a real transfer runs: the transfer completes with exact bytes,
every hostile message is dropped and counted by reason, and nothing raises. An agent answers only the peers the
reservation named, never an address a message carries, and agents under different secrets cannot move KV.
Real UCX on loopback and the in-process fake alike."""

from __future__ import annotations

import dataclasses
import logging
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferState
from tandem.kv_transfer.drops import MessageDrops
from tandem.kv_transfer.fake_transport import Fabric
from tandem.kv_transfer.wire import (HEADER_BYTES, KIND_SHIFT, STATUS_BYTES, DataHeader, Kind, MessageKey, Status,
                                     StatusMessage, make_tag, split_tag, transfer_key)
from tests.kv_transfer.kv_helpers import TRANSPORTS, AgentReplica, layout_of, make_transport, wait_until

SHAPE = dict(num_layers=4, num_heads=4, num_kv_heads=2)
PER = 2 * 16 * 32 * 4  # bytes of one block x layer x KV head (block_size 16, head_dim 32, float32)
MESSAGE = 4 * PER  # a layer-wise message: one layer x one KV head x 4 blocks (max_message_bytes below)
BOUND = HEADER_BYTES + MESSAGE  # the longest DATA message the reservation takes
SRC_BLOCKS, DST_BLOCKS = [5, 2, 7, 0], [1, 8, 3, 6]
CONFIG = TransferConfig(max_message_bytes=MESSAGE, staging_bytes=8 * MESSAGE, lease_s=20.0)


class Pair:
    """A prefill replica (tp=2: two sending ranks) and a one-rank decode replica, plus an attacker transport
    that reaches the decode rank. record: every send the decode rank's agent makes, as (peer, kind)."""

    def __init__(self, kind: str, *, src_config: TransferConfig = CONFIG, dst_config: TransferConfig = CONFIG):
        self.fabric = Fabric()
        self.record: list[tuple[str, Kind]] = []
        self.src = AgentReplica(layout_of(ParallelConfig(tp=2), **SHAPE), num_blocks=10, block_size=16, head_dim=32,
                                kind=kind, fabric=self.fabric, config=src_config, seed=1)
        self.dst = AgentReplica(layout_of(ParallelConfig(), **SHAPE), num_blocks=10, block_size=16, head_dim=32,
                                kind=kind, fabric=self.fabric, config=dst_config, seed=2,
                                transport_wrapper=lambda inner: Recording(inner, self.record))
        self.attacker = make_transport(kind, self.fabric)
        self.agent = self.dst.agents[0]
        self.key = MessageKey(dst_config.secret)  # what a peer that holds the cluster's secret can seal

    def send(self, tag: int, raw) -> None:
        """Sends raw bytes from the attacker to the decode rank (waits until the send is done)."""
        handle = self.attacker.send(self.agent.address, tag, np.frombuffer(bytes(raw), dtype=np.uint8).copy())
        wait_until(handle.done, what="the attacker's send")

    def drops(self) -> MessageDrops:
        return self.agent.stats().drops

    def start_layerwise(self, transfer_id: str, layers: range, lease_s: float = 20.0) -> None:
        """The decode rank reserves DST_BLOCKS (zeroed first); both prefill ranks send `layers` of SRC_BLOCKS."""
        self.agent.kv.data[:, :, DST_BLOCKS] = 0
        desc = self.dst.descriptor(transfer_id, DST_BLOCKS, num_tokens=4 * 16, lease_s=lease_s,
                                   senders=self.src.addresses)
        for agent in self.src.agents:
            agent.arm(desc, seq_id=f"{transfer_id}#0")
        self.compute(transfer_id, layers)

    def compute(self, transfer_id: str, layers: range) -> None:
        for layer in layers:
            for agent in self.src.agents:
                agent.on_layers_done(layer, {f"{transfer_id}#0": tuple(SRC_BLOCKS)})

    def finish(self, transfer_id: str) -> None:
        """Waits for both sides to be DONE; the decode rank holds the source bytes exactly; releases it all."""
        states = lambda: self.dst.states(transfer_id) + self.src.states(transfer_id)  # noqa: E731
        wait_until(lambda: all(s.state is TransferState.DONE for s in states()), what=f"DONE, not {states()}")
        assert np.array_equal(self.agent.read_kv(DST_BLOCKS), self.src.whole[:, :, SRC_BLOCKS].numpy())
        for agent in self.src.agents + self.dst.agents:
            agent.release(transfer_id)
            wait_until(lambda: agent.stats().staging_in_use == 0, what="staging slots back")
            agent.check_integrity()

    def close(self) -> None:
        self.attacker.close()
        self.src.close()
        self.dst.close()


class Recording:
    """A transport that records where its agent sends (peer, kind) and passes everything on."""

    def __init__(self, inner, record: list):
        self.inner, self.record = inner, record

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, peer, tag, buffer):
        self.record.append((peer, split_tag(tag)[1]))
        return self.inner.send(peer, tag, buffer)


@pytest.fixture
def no_errors(caplog):
    """Fails the test if a transfer agent logged an error (an exception it caught)."""
    caplog.set_level(logging.WARNING, logger="tandem.kv_transfer")
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("tandem.kv_transfer")]
    assert not errors, [r.getMessage() for r in errors]


def data(key: MessageKey, tag: int, index: int, *, payload: bytes = b"\x07" * MESSAGE, src_rank: int = 0,
         **changes) -> bytes:
    """A DATA message for the decode rank sealed under key (fields as a real one of message `index`)."""
    fields = dict(index=index, msgs_for_dst=8, src_rank=src_rank, layers=range(index % 4, index % 4 + 1),
                  kv_heads=range(src_rank, src_rank + 1), blocks=range(0, 4), payload_bytes=len(payload))
    return DataHeader(**(fields | changes)).seal(key, tag, payload) + payload


def old_format_data(sender: str) -> bytes:
    """A DATA message in the first wire format, whose header named an address to acknowledge (BOUND bytes)."""
    header = struct.pack("<4sIIIIIIIIIQQ64s", b"TKV1", 0, 8, 0, 0, 1, 0, 1, 0, 4, MESSAGE, 0, sender.encode())
    return header + b"\0" * (BOUND - len(header))


def status(key: MessageKey, tag: int, code: int, rank: int) -> bytes:
    """A status message with any code, sealed under key."""
    body = struct.pack("<IIQ", code, rank, 0)
    return body + key.mac(tag, body)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_hostile_messages_during_a_transfer_are_dropped_and_counted(kind, no_errors):
    pair = Pair(kind)
    try:
        live = transfer_key("live/0")
        pair.start_layerwise("live/0", range(0, 2))  # layers 0-1 on the wire, 2-3 not computed yet
        real, wrong = pair.key, MessageKey(b"not the cluster's secret, another")
        tag = lambda i, k=Kind.DATA, key=live: make_tag(key, k, i)  # noqa: E731
        hostile = [
            ("malformed", tag(5), b"\x01" * 10),  # shorter than a header
            ("forged", tag(5), np.random.default_rng(0).bytes(HEADER_BYTES + 100)),  # random bytes
            ("oversized", tag(5), b"\x02" * (BOUND + 1)),
            ("oversized", tag(5), bytes(8 << 20)),  # drained unread, never allocated
            ("forged", tag(6), data(real, tag(6), 6)[:HEADER_BYTES + 50]),  # an authentic message, truncated
            ("forged", tag(6), data(wrong, tag(6), 6)),  # sealed under another secret
            ("forged", tag(6), bytes(b ^ (i == HEADER_BYTES - 1) for i, b in enumerate(data(real, tag(6), 6)))),
            ("forged", tag(7), data(real, tag(6), 6)),  # another message's valid MAC
            ("malformed", tag(5), data(real, tag(5), 5, payload=b"\x03" * 64, payload_bytes=1 << 40)),
            ("malformed", tag(0, Kind.ABORT), status(real, tag(0, Kind.ABORT), 77, 0)),  # unknown status
            ("malformed", tag(0, Kind.ACK), status(real, tag(0, Kind.ACK), 99, 0)),
            ("forged", tag(0, Kind.ABORT), StatusMessage(Status.ABORTED, 0).seal(wrong, tag(0, Kind.ABORT))),
            ("malformed", tag(1, Kind.ABORT), b"\x00" * 20),  # the wrong length for a status message
            ("unknown_transfer", tag(0, key=live ^ 1), data(real, tag(0, key=live ^ 1), 0)),
            ("unknown_transfer", tag(0, Kind.ACK, live ^ 1), StatusMessage(Status.OK, 0).seal(real, tag(0, Kind.ACK,
                                                                                                  live ^ 1))),
            ("malformed", (live << 16) | (9 << KIND_SHIFT), b"\x04" * 40),  # a kind we do not know
            ("forged", tag(5), old_format_data(pair.attacker.address)),
        ]
        for _, message_tag, raw in hostile:
            pair.send(message_tag, raw)
        want = MessageDrops(**{r: sum(1 for reason, _, _ in hostile if reason == r) for r in
                               ("forged", "malformed", "oversized", "unknown_transfer")})
        wait_until(lambda: pair.drops().total == want.total, what=f"{want.total} drops, not {pair.drops()}")
        assert pair.drops() == want
        wait_until(lambda: pair.dst.states("live/0")[0].nbytes == 2 * 2 * MESSAGE, what="layers 0-1")
        assert pair.dst.states("live/0")[0].state is TransferState.TRANSFERRING  # untouched by any of it
        pair.compute("live/0", range(2, 4))
        pair.finish("live/0")
        assert pair.attacker.probe(0, 0) is None  # nobody answered the attacker
        assert {peer for peer, _ in pair.record} == set(pair.src.addresses)
    finally:
        pair.close()


def expected_reason(kind: str, live: bool, length: int) -> str:
    """Why the decode rank drops random bytes of `length` sent as `kind` under the live or an unknown key."""
    if kind == "other":
        return "malformed"
    if kind == "data":
        if length < HEADER_BYTES:
            return "malformed"
        if not live:
            return "unknown_transfer"
        return "oversized" if length > BOUND else "forged"
    return "forged" if length == STATUS_BYTES else "malformed"


LENGTHS = st.one_of(st.integers(0, 200), st.integers(HEADER_BYTES - 2, HEADER_BYTES + 2),
                    st.integers(BOUND - 2, BOUND + 2), st.integers(0, 3 * BOUND), st.just(STATUS_BYTES))
MESSAGES = st.lists(st.tuples(st.sampled_from(["data", "ack", "abort", "other"]), st.booleans(), LENGTHS,
                              st.integers(0, 4095), st.sampled_from([0, 4, 5, 8, 11, 15])), max_size=8)


@pytest.fixture(scope="module")
def ucx_pair():
    pair = Pair("ucx")
    yield pair
    pair.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=MESSAGES, seed=st.integers(0, 2**32 - 1))
def test_random_bytes_at_a_live_agent_are_dropped_and_the_transfer_completes(ucx_pair, messages, seed):
    pair, rng = ucx_pair, np.random.default_rng(seed)
    transfer_id = f"random-{seed}/0"
    live = transfer_key(transfer_id)
    before = pair.drops()
    pair.start_layerwise(transfer_id, range(0, 2))
    want: dict[str, int] = {}
    for kind, on_live, length, index, other in messages:
        key = live if on_live else (live ^ int(rng.integers(1, 1 << 47)))
        tag = (key << 16) | (other << KIND_SHIFT) | index if kind == "other" else \
            make_tag(key, {"data": Kind.DATA, "ack": Kind.ACK, "abort": Kind.ABORT}[kind], index)
        pair.send(tag, rng.bytes(length))
        reason = expected_reason(kind, on_live, length)
        want[reason] = want.get(reason, 0) + 1
    expected = before + MessageDrops(**want)
    wait_until(lambda: pair.drops().total == expected.total, what=f"{expected}, not {pair.drops()}")
    assert pair.drops() == expected
    pair.compute(transfer_id, range(2, 4))
    pair.finish(transfer_id)


def test_an_agent_answers_only_the_senders_it_was_given():
    """Authentic messages (a peer holding the secret) for transfers that ended or were never reserved, carrying
    a bystander's address in every place an address could be: the bystander hears nothing; a late message is
    answered at the address the reservation named for its source rank; with no senders named, nobody is."""
    pair = Pair("fake")
    bystander = make_transport("fake", pair.fabric)
    try:
        pair.start_layerwise("done/0", range(4))
        pair.finish("done/0")  # released: its tombstone remembers the senders
        sent = len(pair.record)
        marked = bystander.address.encode() * (MESSAGE // len(bystander.address))
        payload = marked + b"\0" * (MESSAGE - len(marked))
        late = transfer_key("done/0")
        pair.send(make_tag(late, Kind.DATA, 3), data(pair.key, make_tag(late, Kind.DATA, 3), 3, payload=payload,
                                                     src_rank=1))
        pair.send(make_tag(late ^ 5, Kind.DATA, 0), data(pair.key, make_tag(late ^ 5, Kind.DATA, 0), 0,
                                                         payload=payload))
        wait_until(lambda: pair.drops().late == 1 and pair.drops().unknown_transfer == 1, what="both dropped")
        assert pair.record[sent:] == [(pair.src.addresses[1], Kind.ACK)]  # source rank 1, told the outcome
        # A reservation that names no senders: the transfer completes here, and nobody is told.
        pair.agent.kv.data[:, :, DST_BLOCKS] = 0
        desc = pair.dst.descriptor("quiet/0", DST_BLOCKS, num_tokens=64, lease_s=1.0)
        sent = len(pair.record)
        for agent in pair.src.agents:
            agent.arm(desc)
            agent.send_all("quiet/0", SRC_BLOCKS)
        wait_until(lambda: pair.dst.states("quiet/0")[0].state is TransferState.DONE, what="the data")
        assert np.array_equal(pair.agent.read_kv(DST_BLOCKS), pair.src.whole[:, :, SRC_BLOCKS].numpy())
        wait_until(lambda: all(s.state is TransferState.EXPIRED for s in pair.src.states("quiet/0")),
                   what="the senders' leases")  # no acknowledgement came: the lease decides
        assert pair.record[sent:] == [] and bystander.probe(0, 0) is None
    finally:
        bystander.close()
        pair.close()


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_agents_under_different_secrets_cannot_move_kv(kind, no_errors):
    pair = Pair(kind, dst_config=dataclasses.replace(CONFIG, secret=b"another cluster entirely, 32 B!"))
    try:
        before = pair.agent.read_kv(DST_BLOCKS)
        desc = pair.dst.descriptor("r/0", DST_BLOCKS, num_tokens=64, lease_s=1.5, senders=pair.src.addresses)
        for agent in pair.src.agents:
            agent.arm(desc)
            agent.send_all("r/0", SRC_BLOCKS)
        states = lambda: pair.dst.states("r/0") + pair.src.states("r/0")  # noqa: E731
        wait_until(lambda: all(s.state is TransferState.EXPIRED for s in states()), what=f"EXPIRED: {states()}")
        # Each sending rank: 4 DATA messages (its KV head x all 4 layers, a block each), an ACK saying it sent them
        # all, then an ABORT (EXPIRED).
        wait_until(lambda: pair.drops().total == 2 * (4 + 2), what=f"12 drops, not {pair.drops()}")
        assert pair.drops() == MessageDrops(forged=2 * (4 + 2))
        assert np.array_equal(pair.agent.read_kv(DST_BLOCKS), before)  # nothing written
        assert all(agent.stats().drops == MessageDrops() for agent in pair.src.agents)  # nobody answered them
    finally:
        pair.close()
