"""The transport contract, run against the real UCX transport (loopback) and the in-process fake alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.kv_transfer.fake_transport import Fabric
from tandem.kv_transfer.transport import Probe
from tandem.kv_transfer.wire import KEY_SHIFT, KIND_MASK, Kind, make_tag
from tests.kv_transfer.kv_helpers import TRANSPORTS, make_transport, nowhere, wait_until


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    fabric = Fabric()
    a, b = make_transport(request.param, fabric), make_transport(request.param, fabric)
    yield request.param, fabric, a, b
    a.close()
    b.close()


def arrival(transport, tag: int, mask: int) -> Probe:
    """Waits for a message matching (tag, mask) and returns its probe."""
    probe = None

    def arrived():
        nonlocal probe
        probe = transport.probe(tag, mask)
        return probe is not None

    wait_until(arrived, what="a message")
    return probe


def receive(transport, tag: int, mask: int, size_hint: int = 0) -> tuple[int, bytes]:
    probe = arrival(transport, tag, mask)
    buffer = np.zeros(max(probe.length, size_hint), dtype=np.uint8)
    handle = transport.receive(probe, buffer)
    wait_until(handle.done, what="the receive")
    assert handle.error() is None
    return probe.tag, bytes(buffer[:probe.length])


def test_tagged_messages_arrive_whole_and_are_selected_by_kind(pair):
    _, _, a, b = pair
    big = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)  # rendezvous-sized
    small = np.frombuffer(b"status!!", dtype=np.uint8).copy()
    sends = [a.send(b.address, make_tag(7, Kind.DATA, 3), big), a.send(b.address, make_tag(7, Kind.ACK, 1), small)]
    tag, data = receive(b, make_tag(0, Kind.ACK, 0), KIND_MASK)
    assert tag == make_tag(7, Kind.ACK, 1) and data == b"status!!"
    tag, data = receive(b, make_tag(0, Kind.DATA, 0), KIND_MASK)
    assert tag == make_tag(7, Kind.DATA, 3) and data == big.tobytes()
    wait_until(lambda: all(s.done() for s in sends), what="the sends")
    assert [s.error() for s in sends] == [None, None]
    assert b.probe(0, 0) is None  # nothing else arrived


@pytest.mark.parametrize("size", [200, 3 << 20], ids=["eager", "rendezvous"])
def test_a_receive_into_a_short_buffer_drains_the_message(pair, size):
    """How an agent drops a message without making room for it: the receive fails (truncated) and writes
    nothing past the short buffer, the sender's send completes, and the next message arrives whole."""
    _, _, a, b = pair
    sent = a.send(b.address, make_tag(3, Kind.DATA, 1), np.full(size, 7, dtype=np.uint8))
    probe = arrival(b, make_tag(0, Kind.DATA, 0), KIND_MASK)
    room = np.zeros(128, dtype=np.uint8)
    drained = b.receive(probe, room[:64])
    wait_until(lambda: drained.done() and sent.done(), what="the drain")
    assert drained.error() is not None and sent.error() is None
    assert not room[64:].any()
    assert b.probe(0, 0) is None  # taken off the wire
    after = a.send(b.address, make_tag(4, Kind.ACK, 0), np.arange(48, dtype=np.uint8))
    assert receive(b, make_tag(0, Kind.ACK, 0), KIND_MASK) == (make_tag(4, Kind.ACK, 0), bytes(range(48)))
    wait_until(after.done, what="the next send")


def test_messages_of_one_kind_come_oldest_first(pair):
    _, _, a, b = pair
    for i in range(5):
        a.send(b.address, make_tag(i + 1, Kind.ACK, 0), np.full(16, i, dtype=np.uint8))
    got = [receive(b, make_tag(0, Kind.ACK, 0), KIND_MASK)[1][0] for _ in range(5)]
    assert got == [0, 1, 2, 3, 4]


def test_a_send_to_nobody_fails_instead_of_hanging(pair):
    kind, fabric, a, b = pair
    handle = a.send(nowhere(kind), make_tag(1, Kind.DATA, 0), np.zeros(1 << 20, dtype=np.uint8))
    wait_until(handle.done, timeout_s=30, what="the failed send to finish")
    assert handle.error() is not None


def test_after_a_dead_peer_the_next_peer_is_reached(pair):
    kind, fabric, a, b = pair
    address = nowhere(kind)
    failed = a.send(address, make_tag(1, Kind.DATA, 0), np.zeros(1 << 20, dtype=np.uint8))
    wait_until(failed.done, timeout_s=30, what="the failed send")
    a.forget_peer(address)
    ok = a.send(b.address, make_tag(2, Kind.DATA, 0), np.ones(1 << 20, dtype=np.uint8))
    tag, data = receive(b, make_tag(0, Kind.DATA, 0), KIND_MASK)
    wait_until(ok.done, what="the send")
    assert ok.error() is None and tag == make_tag(2, Kind.DATA, 0) and data == b"\x01" * (1 << 20)


def test_a_forgotten_connection_reconnects_on_the_next_send(pair):
    _, _, a, b = pair
    for i in range(3):
        handle = a.send(b.address, make_tag(i + 1, Kind.ACK, 0), np.full(8, i, dtype=np.uint8))
        assert receive(b, make_tag(0, Kind.ACK, 0), KIND_MASK)[1] == bytes([i]) * 8
        wait_until(handle.done, what="the send")
        assert handle.error() is None
        a.forget_peer(b.address)


def test_forgetting_a_failed_send_closes_only_its_own_connection(pair):
    """forget_peer(peer, handle) for a send of a connection already replaced leaves the newer one alone: what went
    out on it since (an agent's ABORT about that failure) arrives."""
    _, _, a, b = pair
    old = a.send(b.address, make_tag(1, Kind.ACK, 0), np.full(8, 1, dtype=np.uint8))
    assert receive(b, make_tag(0, Kind.ACK, 0), KIND_MASK)[1] == b"\x01" * 8
    wait_until(old.done, what="the first send")
    a.forget_peer(b.address)  # the first connection failed
    abort = a.send(b.address, make_tag(2, Kind.ABORT, 0), np.full(48, 2, dtype=np.uint8))  # over a new one
    a.forget_peer(b.address, old)  # the failure of a send of the first connection, booked late
    assert receive(b, make_tag(0, Kind.ABORT, 0), KIND_MASK) == (make_tag(2, Kind.ABORT, 0), b"\x02" * 48)
    wait_until(abort.done, what="the ABORT's send")
    assert abort.error() is None


def test_a_send_cut_by_forget_peer_keeps_its_buffer_until_the_transport_is_done_with_it(pair):
    """A send queued on a fresh connection, which forget_peer closes at once: whatever the peer receives is what
    was sent, however soon the sender reuses the buffer once the handle is done (a staging slot goes back to its
    pool then). Repeated: the race between UCX flushing the send and the reuse is short."""
    _, _, a, b = pair
    originals = []
    for i in range(40):
        payload = np.full(48, i + 1, dtype=np.uint8)
        handle = a.send(b.address, make_tag(i + 1, Kind.ABORT, 0), payload)
        a.forget_peer(b.address)
        wait_until(handle.done, timeout_s=30, what="the cut send")
        payload[:] = 0xEE  # reused at once
        originals.append(bytes([i + 1]) * 48)
    sentinel = a.send(b.address, make_tag(99, Kind.ACK, 0), np.full(8, 9, dtype=np.uint8))
    assert receive(b, make_tag(0, Kind.ACK, 0), KIND_MASK)[1] == b"\x09" * 8
    wait_until(sentinel.done, what="the last send")
    while (probe := b.probe(make_tag(0, Kind.ABORT, 0), KIND_MASK)) is not None:
        buffer = np.zeros(probe.length, dtype=np.uint8)
        got = b.receive(probe, buffer)
        wait_until(got.done, what="a cut send's receive")
        if got.error() is None:
            index = (probe.tag >> KEY_SHIFT) - 1
            assert bytes(buffer) == originals[index], (probe.tag, bytes(buffer[:8]))


def test_torch_host_tensors_are_sent_and_received_as_their_bytes(pair):
    """The agent's direct path hands the transport torch tensors (host ones beside a CPU store)."""
    _, _, a, b = pair
    data = torch.arange(1 << 18, dtype=torch.int32).view(torch.uint8)  # 1 MiB: rendezvous-sized on UCX
    sent = a.send(b.address, make_tag(9, Kind.DATA, 2), data)
    probe = arrival(b, make_tag(0, Kind.DATA, 0), KIND_MASK)
    into = torch.zeros(probe.length + 64, dtype=torch.uint8)
    got = b.receive(probe, into)
    wait_until(lambda: got.done() and sent.done(), what="the transfer")
    assert got.error() is None and sent.error() is None
    assert torch.equal(into[:probe.length], data) and not into[probe.length:].any()


def test_transports_say_whether_they_move_device_memory(pair):
    _, _, a, b = pair
    for transport in (a, b):
        assert isinstance(transport.device_transports, tuple)
        if not torch.cuda.is_available():
            assert transport.device_transports == ()  # without a GPU: host buffers only
