"""Same-host transfers by reference (kv_transfer/shm.py): payloads stay in the sender's shared staging and
arrive exactly; slots are held until the destination rank's ACK; a slot given back early has its stamp cleared,
which fails a read still running (and no other transfer's); refs that do not name the sender's segment, or that
were forged, are refused; a full pool is waited on by send_all and sent around by the layer hook; agents say
when and why the path is off."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer import shm
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferState
from tandem.kv_transfer.fake_transport import Fabric
from tandem.kv_transfer.shm import HEADER_PAGE, PeerSegments, SharedSegment, ShmUnavailable
from tandem.kv_transfer.wire import (HEADER_BYTES, KIND_SHIFT, REF_BYTES, DataHeader, ForgedMessage, Kind,
                                     MalformedMessage, MessageKey, ShmRef, make_tag, transfer_key)
from tests.kv_transfer.kv_helpers import AgentReplica, layout_of, wait_until

pytestmark = pytest.mark.skipif(not shm.domain(), reason="shared-memory transfers need Linux on x86-64 with /proc")

SHAPE = dict(num_layers=4, num_heads=4, num_kv_heads=2)
PER_BLOCK = 4 * 2 * 2 * 16 * 8 * 4  # all layers, K|V, KV heads, block_size, head_dim, float32


class Gate:
    """A receiving transport wrapper that shows no arrived message while closed, and none of the kinds in
    `held` (they wait on the wire)."""

    def __init__(self, inner):
        self.inner, self.closed, self.held = inner, False, set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def probe(self, tag, mask):
        if self.closed or (tag >> KIND_SHIFT) & 0xF in self.held:
            return None
        return self.inner.probe(tag, mask)


def pair(config: TransferConfig, *, gate: bool = False, num_blocks: int = 12):
    fabric = Fabric()
    layout = layout_of(ParallelConfig(), **SHAPE)
    src = AgentReplica(layout, num_blocks=num_blocks, block_size=16, head_dim=8, kind="fake", fabric=fabric,
                       config=config, seed=1)
    dst = AgentReplica(layout, num_blocks=num_blocks, block_size=16, head_dim=8, kind="fake", fabric=fabric,
                       config=config, seed=2, transport_wrapper=Gate if gate else None)
    return src, dst


def settle(src, dst, transfer_id: str):
    wait_until(lambda: all(s.state.terminal for s in src.states(transfer_id) + dst.states(transfer_id)),
               what=f"{transfer_id} to end on both sides")
    return src.states(transfer_id)[0], dst.states(transfer_id)[0]


def test_payloads_by_reference_arrive_exactly_and_slots_come_back_with_the_ack():
    config = TransferConfig(shared_memory=True, max_message_bytes=2 * PER_BLOCK, staging_bytes=16 * PER_BLOCK)
    src, dst = pair(config)
    sender, receiver = src.agents[0], dst.agents[0]
    try:
        assert sender.stats().shared_memory == "on" and sender.shared_memory_domain() == shm.domain()
        before = dst.whole.clone()
        transfers = {"scattered/0": ([9, 2, 7, 0, 5], [1, 8, 3, 4, 6]), "run/0": ([3, 4, 5], [9, 10, 11])}
        for transfer_id, (blocks_from, blocks_to) in transfers.items():
            desc = dst.descriptor(transfer_id, blocks_to, 16 * len(blocks_to), senders=src.addresses,
                                  shared_memory=True)
            sender.arm(desc)
            sender.send_all(transfer_id, blocks_from)
            assert [s.state for s in settle(src, dst, transfer_id)] == [TransferState.DONE] * 2
            assert dst.holds(blocks_to, src.whole[:, :, blocks_from])
        assert sender.stats().by_reference == 3 + 2  # messages of at most two blocks
        assert sender.stats().one_off_buffers == 0
        moved = {b for _, to in transfers.values() for b in to}
        untouched = [b for b in range(12) if b not in moved]
        assert dst.holds(untouched, before[:, :, untouched])
        wait_until(lambda: sender.stats().staging_in_use == 0, what="the acknowledged slots back")
        for agent in (sender, receiver):
            for transfer_id in transfers:
                agent.release(transfer_id)
            agent.check_integrity()
    finally:
        src.close()
        dst.close()


def test_a_descriptor_without_the_domain_gets_payloads():
    src, dst = pair(TransferConfig(shared_memory=True, max_message_bytes=2 * PER_BLOCK, staging_bytes=16 * PER_BLOCK))
    try:
        desc = dst.descriptor("plain/0", [1, 2], 32, senders=src.addresses)  # no shm_domains
        src.agents[0].arm(desc)
        src.agents[0].send_all("plain/0", [4, 6])
        assert [s.state for s in settle(src, dst, "plain/0")] == [TransferState.DONE] * 2
        assert dst.holds([1, 2], src.whole[:, :, [4, 6]])
        assert src.agents[0].stats().by_reference == 0
    finally:
        src.close()
        dst.close()


def test_a_slot_given_back_during_the_read_fails_that_transfer_only():
    """The sender gives up one transfer while its messages and another transfer's wait on the receiver's side:
    the first's slots come back at once with their stamps cleared, and the receiver, reading them afterwards,
    refuses that transfer instead of keeping bytes that may have been overwritten; the other transfer, whose
    slots were sent before and read after, arrives whole."""
    src, dst = pair(TransferConfig(shared_memory=True, max_message_bytes=2 * PER_BLOCK, staging_bytes=16 * PER_BLOCK),
                    gate=True)
    sender, receiver = src.agents[0], dst.agents[0]
    try:
        receiver.transport.closed = True
        for transfer_id, blocks_to in (("kept/0", [7, 8]), ("cut/0", [1, 2, 3])):
            desc = dst.descriptor(transfer_id, blocks_to, 16 * len(blocks_to), senders=src.addresses,
                                  shared_memory=True)
            sender.arm(desc)
            sender.send_all(transfer_id, [4, 5, 6][:len(blocks_to)])
        assert sender.stats().by_reference == 3
        sender.abort("cut/0")  # its slots go back although nobody acknowledged them
        wait_until(lambda: sender.stats().staging_in_use == 1, what="the aborted transfer's slots back")
        receiver.transport.held = {Kind.ABORT}  # the receiver reads the DATA before it hears of the abort
        receiver.transport.closed = False
        wait_until(lambda: dst.states("cut/0")[0].state.terminal, what="the receiver to end the transfer")
        status = dst.states("cut/0")[0]
        assert status.state is TransferState.FAILED, status
        assert "the sender took its slot back while this rank read it" in status.error
        receiver.transport.held = set()
        assert [s.state for s in settle(src, dst, "kept/0")] == [TransferState.DONE] * 2
        assert dst.holds([7, 8], src.whole[:, :, [4, 5]])
        for transfer_id in ("kept/0", "cut/0"):
            sender.release(transfer_id)
            receiver.release(transfer_id)
        receiver.check_integrity()
        sender.check_integrity()
    finally:
        src.close()
        dst.close()


def test_refs_to_another_segment_or_past_its_end_are_refused():
    staging = SharedSegment(1 << 16)
    peers = PeerSegments()
    try:
        staging.buffer[64:68] = [1, 2, 3, 4]
        good = staging.ref(64, 4)
        assert peers.view(good).tolist() == [1, 2, 3, 4]
        assert not peers.view(good).flags.writeable
        assert peers.still_valid(good)
        staging.clear(good.offset - HEADER_PAGE)
        assert not peers.still_valid(good)
        with pytest.raises(ShmUnavailable, match="not the staging segment"):
            peers.view(ShmRef(good.pid, good.fd, b"x" * 16, good.offset, 4, 0))  # another nonce: fd reused
        with pytest.raises(ShmUnavailable, match="cannot open"):
            peers.view(ShmRef(good.pid, 10_000, good.nonce, good.offset, 4, 0))
        with pytest.raises(ShmUnavailable, match="a ref to bytes"):
            peers.view(ShmRef(good.pid, good.fd, good.nonce, HEADER_PAGE + (1 << 16) - 8, 16, 0))
        with pytest.raises(ShmUnavailable, match="a ref to bytes"):
            peers.view(ShmRef(good.pid, good.fd, good.nonce, 8, 4, 0))  # the segment's own header
        with pytest.raises(ValueError, match="no aligned room"):
            staging.ref(4, 4)
    finally:
        staging.close()


def test_a_receiver_refuses_a_ref_it_cannot_read_and_fails_only_that_transfer():
    """An authentic message (sealed with the cluster's key) whose ref names no segment of the sender: the
    transfer fails with the reason; a MAC-less forgery of the same is dropped without touching it."""
    config = TransferConfig(shared_memory=True, max_message_bytes=2 * PER_BLOCK, staging_bytes=16 * PER_BLOCK)
    src, dst = pair(config)
    sender, receiver = src.agents[0], dst.agents[0]
    try:
        for transfer_id, key in (("forged/0", MessageKey(b"not the cluster's secret at all")),
                                 ("lost/0", MessageKey(config.secret))):
            dst.descriptor(transfer_id, [1, 2], 32, senders=src.addresses, shared_memory=True)
            ref = ShmRef(os.getpid(), 10_000, b"n" * 16, HEADER_PAGE + 128, 2 * PER_BLOCK, 1)
            header = DataHeader(0, 1, 0, range(0, 4), range(0, 2), range(0, 2), 2 * PER_BLOCK, ref)
            tag = make_tag(transfer_key(transfer_id), Kind.DATA, 0)
            message = np.frombuffer(header.seal(key, tag, b"") + ref.pack(), dtype=np.uint8)
            sender.transport.send(receiver.address, tag, message)
        wait_until(lambda: dst.states("lost/0")[0].state.terminal, what="the authentic bad ref refused")
        assert dst.states("lost/0")[0].state is TransferState.FAILED
        assert "cannot open the sender's staging segment" in dst.states("lost/0")[0].error
        wait_until(lambda: receiver.stats().drops.forged == 1, what="the forgery dropped")
        assert dst.states("forged/0")[0].state is TransferState.RESERVED
    finally:
        src.close()
        dst.close()


def test_a_ref_is_covered_by_the_mac_and_must_match_the_header():
    key, tag = MessageKey(b"k" * 32), make_tag(transfer_key("r/0"), Kind.DATA, 0)
    ref = ShmRef(123, 7, b"n" * 16, HEADER_PAGE, 4096, 5)
    header = DataHeader(0, 1, 0, range(0, 1), range(0, 1), range(0, 1), 4096, ref)
    message = np.frombuffer(header.seal(key, tag, b"") + ref.pack(), dtype=np.uint8)
    assert len(message) == HEADER_BYTES + REF_BYTES
    assert DataHeader.open(key, tag, message) == header
    tampered = message.copy()
    tampered[HEADER_BYTES + 8] ^= 1  # the nonce
    with pytest.raises(ForgedMessage):
        DataHeader.open(key, tag, tampered)
    with pytest.raises(ValueError, match="a ref to 4096 bytes for a payload of 8192"):
        DataHeader(0, 1, 0, range(0, 1), range(0, 1), range(0, 1), 8192, ref).seal(key, tag, b"")
    short = np.concatenate([message[:HEADER_BYTES - 32], message[HEADER_BYTES:-1]])
    fields = short[:HEADER_BYTES - 32]
    resealed = np.concatenate([fields, np.frombuffer(key.mac(tag, fields, short[HEADER_BYTES - 32:]),
                                                     dtype=np.uint8), short[HEADER_BYTES - 32:]])
    with pytest.raises(MalformedMessage, match="a ref of"):
        DataHeader.open(key, tag, resealed)


def test_send_all_waits_for_room_and_the_layer_hook_sends_around_a_full_pool():
    """The pool holds three messages. A transfer of four sends its last one with its payload (its own slots
    come back only with its ACK: it does not wait on itself); the next transfer, sent while the first's slots
    are still held, waits until the receiver acknowledges the first and goes by reference; layer-wise sends
    never wait."""
    config = TransferConfig(shared_memory=True, max_message_bytes=PER_BLOCK,
                            staging_bytes=3 * (PER_BLOCK + HEADER_BYTES + 64), room_wait_s=10.0)
    src, dst = pair(config, gate=True, num_blocks=16)
    sender, receiver = src.agents[0], dst.agents[0]
    try:
        receiver.transport.closed = True
        big = dst.descriptor("big/0", [0, 1, 2, 3], 64, senders=src.addresses, shared_memory=True)
        sender.arm(big)
        sender.send_all("big/0", [8, 9, 10, 11])
        assert (sender.stats().by_reference, sender.stats().one_off_buffers) == (3, 1)
        second = dst.descriptor("next/0", [4, 5], 32, senders=src.addresses, shared_memory=True)
        sender.arm(second)
        opener = threading.Timer(0.3, lambda: setattr(receiver.transport, "closed", False))
        started = time.monotonic()
        opener.start()
        sender.send_all("next/0", [12, 13])
        assert 0.3 <= time.monotonic() - started < 10.0  # waited for the first transfer's ACK, not in vain
        opener.join()
        assert (sender.stats().by_reference, sender.stats().one_off_buffers) == (5, 1)
        for transfer_id, blocks_from, blocks_to in (("big/0", [8, 9, 10, 11], [0, 1, 2, 3]),
                                                     ("next/0", [12, 13], [4, 5])):
            assert [s.state for s in settle(src, dst, transfer_id)] == [TransferState.DONE] * 2
            assert dst.holds(blocks_to, src.whole[:, :, blocks_from])
        wait_until(lambda: sender.stats().staging_in_use == 0, what="every slot back")
        receiver.transport.closed = True
        layered = dst.descriptor("layers/0", [6, 7, 14, 15, 11], 80, senders=src.addresses, shared_memory=True)
        sender.arm(layered, seq_id="s#0")
        started = time.monotonic()
        for layer in range(4):
            sender.on_layers_done(layer, {"s#0": (0, 1, 2, 3, 4)})
        assert time.monotonic() - started < 5.0  # never waited for room (room_wait_s: 10 s)
        assert sender.stats().one_off_buffers > 1 and sender.stats().by_reference > 5
        receiver.transport.closed = False
        assert [s.state for s in settle(src, dst, "layers/0")] == [TransferState.DONE] * 2
        assert dst.holds([6, 7, 14, 15, 11], src.whole[:, :, [0, 1, 2, 3, 4]])
        for agent in (sender, receiver):
            for transfer_id in ("big/0", "next/0", "layers/0"):
                agent.release(transfer_id)
        wait_until(lambda: sender.stats().staging_in_use == 0, what="every slot back")
        sender.check_integrity()
        receiver.check_integrity()
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("config, why", [
    (TransferConfig(shared_memory=False), "off (shared_memory: false)"),
    (TransferConfig(shared_memory=True, kv_path="direct"), "off (KV store on cpu)"),
])
def test_agents_say_why_the_path_is_off(config, why):
    src, dst = pair(config)
    try:
        assert src.agents[0].stats().shared_memory == why
        assert src.agents[0].shared_memory_domain() == ""
    finally:
        src.close()
        dst.close()


def test_a_receiver_drops_mappings_of_senders_that_exited():
    """A sender process makes a segment and exits; the receiver maps it while it lives, and the mapping goes
    when the next segment is mapped."""
    code = ("import os, sys, time; from tandem.kv_transfer.shm import SharedSegment; s = SharedSegment(4096); "
            "s.buffer[8:11] = [7, 8, 9]; r = s.ref(8, 3); "
            "print(r.pid, r.fd, r.nonce.hex(), r.offset, flush=True); sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    peers = PeerSegments(max_mappings=4)
    mine = SharedSegment(4096)
    try:
        pid, fd, nonce, offset = child.stdout.readline().split()
        ref = ShmRef(int(pid), int(fd), bytes.fromhex(nonce), int(offset), 3, 0)
        assert peers.view(ref).tolist() == [7, 8, 9]
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=30)
        peers.view(mine.ref(8, 3))
        assert len(peers._maps) == 1
    finally:
        if child.poll() is None:
            child.kill()
        mine.close()


def test_store_refs_read_strided_slices_and_refuse_ones_that_leave_the_segment():
    segment = SharedSegment(1 << 16)
    peers = PeerSegments()
    try:
        segment.buffer[:4096] = np.arange(4096) % 251
        whole = np.arange(4096) % 251
        # 2 layers x K|V x 3 blocks of 8 bytes, layers 1024 bytes apart, halves 512, blocks 64, from byte 128
        ref = ShmRef(segment.pid, segment.fd, segment.nonce, HEADER_PAGE + 128, 2 * 2 * 3 * 8, 0, (1024, 512, 64))
        got = peers.store_slice(ref, (2, 2, 3, 8))
        want = np.stack([np.stack([np.stack([whole[128 + layer * 1024 + half * 512 + b * 64:][:8] for b in range(3)])
                                   for half in range(2)]) for layer in range(2)])
        assert np.array_equal(got, want) and not got.flags.writeable
        with pytest.raises(ShmUnavailable, match="leaves|to bytes"):
            peers.store_slice(ShmRef(segment.pid, segment.fd, segment.nonce, HEADER_PAGE, 96, 0, (1 << 16, 512, 64)),
                              (2, 2, 3, 8))
        with pytest.raises(ShmUnavailable, match="strides"):
            peers.store_slice(ShmRef(segment.pid, segment.fd, segment.nonce, HEADER_PAGE, 96, 0, (0, 512, 64)),
                              (2, 2, 3, 8))
        with pytest.raises(ShmUnavailable, match="strides"):  # a length that is not the slice's
            peers.store_slice(ShmRef(segment.pid, segment.fd, segment.nonce, HEADER_PAGE, 95, 0, (1024, 512, 64)),
                              (2, 2, 3, 8))
    finally:
        segment.close()
