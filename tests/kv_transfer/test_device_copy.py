"""KVCopier, the one place bytes move between a KV store and message slots, and the agent's device paths: the
copier round-trips exact bytes (any dtype, NaN bit patterns included, blocks out of order, a rank's share of
layers and heads) and refuses what it cannot do exactly; agents on either path move a request's KV byte for
byte, in one process and between two processes. The cuda cases need a GPU (marked gpu, skipped without one)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer.agent import KVTransferAgent
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferState
from tandem.kv_transfer.device_copy import KVCopier
from tandem.kv_transfer.fake_transport import Fabric, FakeTransport
from tandem.kv_transfer.ucx_transport import between_processes, cuda_transports
from tandem.kv_transfer.wire import Kind, split_tag
from tests.kv_transfer.kv_helpers import (TRANSPORTS, AgentReplica, ProcessSide, SideProcess, layout_of,
                                          wait_until)

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda case needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
BLOCK, HEAD_DIM = 16, 8
LAYERS, HEADS = range(3, 7), range(1, 4)  # a rank's share: global layers 3-6, KV heads 1-3


def random_store(device: str, dtype: torch.dtype, seed: int, num_blocks: int = 10) -> torch.Tensor:
    """A store [layers, 2, blocks, KV heads, block_size, head_dim] of random bytes: NaN and inf bit patterns too."""
    shape = (len(LAYERS), 2, num_blocks, len(HEADS), BLOCK, HEAD_DIM)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).view(shape).to(device)


def raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of t, [..., bytes of the last dim]: equal bytes, not equal values (NaN != NaN)."""
    return t.cpu().contiguous().view(torch.uint8).numpy()


def payload_bytes(layers: range, heads: range, num_blocks: int, dtype: torch.dtype) -> int:
    return len(layers) * 2 * num_blocks * len(heads) * BLOCK * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_gather_then_scatter_moves_exact_bytes_between_scattered_blocks(device, dtype):
    src, dst = random_store(device, dtype, 1), random_store(device, dtype, 2)
    before = dst.clone()
    sender, receiver = KVCopier(src, LAYERS, HEADS), KVCopier(dst, LAYERS, HEADS)
    layers, heads = range(4, 6), range(2, 4)  # a slice inside the share, not at its start
    src_ids, dst_ids = [7, 2, 9, 0], [1, 8, 3, 5]
    payload = sender.host_buffer(payload_bytes(layers, heads, 4, dtype))
    sender.gather_into(payload, layers, heads, src_ids).wait()
    receiver.scatter_from(payload, layers, heads, dst_ids)
    want = raw(before)
    want[1:3, :, dst_ids, 1:3] = raw(src)[1:3, :, src_ids, 1:3]  # layers 4-5, heads 2-3 of the share; nothing else
    assert np.array_equal(raw(dst), want)


@pytest.mark.parametrize("device", DEVICES)
def test_payload_is_the_wire_layout_of_the_slice(device):
    """[layers, K|V, blocks, KV heads, block_size, head_dim], as a peer on another device reads it."""
    src = random_store(device, torch.float32, 3)
    layers, heads, ids = range(3, 7), range(1, 3), [6, 4]
    payload = KVCopier(src, LAYERS, HEADS).host_buffer(payload_bytes(layers, heads, 2, torch.float32))
    KVCopier(src, LAYERS, HEADS).gather_into(payload, layers, heads, ids).wait()
    want = src[:, :, ids][:, :, :, 0:2].cpu().numpy()
    assert np.array_equal(payload.view(np.float32).reshape(want.shape).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
def test_copies_started_together_each_land_whole(device):
    """The agent starts message i+1's copy before it waits on message i's: every one is complete after wait()."""
    src, dst = random_store(device, torch.bfloat16, 4, 40), random_store(device, torch.bfloat16, 5, 40)
    sender, receiver = KVCopier(src, LAYERS, HEADS), KVCopier(dst, LAYERS, HEADS)
    order = [int(b) for b in np.random.default_rng(0).permutation(40)]
    runs = [order[i:i + 5] for i in range(0, 40, 5)]
    started = []
    for ids in runs:
        buf = sender.host_buffer(payload_bytes(LAYERS, HEADS, len(ids), torch.bfloat16))
        started.append((ids, buf, sender.gather_into(buf, LAYERS, HEADS, ids)))
    for ids, buf, copy in started:
        copy.wait()
        receiver.scatter_from(buf, LAYERS, HEADS, sorted(ids))
    for ids in runs:
        assert np.array_equal(raw(dst[:, :, sorted(ids)]), raw(src[:, :, ids]))


@pytest.mark.parametrize("device", DEVICES)
def test_device_side_slots_round_trip_and_mirror_to_host(device):
    """The direct path: gathered into a device-side slot (with a host copy for the MAC), scattered from one."""
    src, dst = random_store(device, torch.bfloat16, 6), random_store(device, torch.bfloat16, 7)
    sender, receiver = KVCopier(src, LAYERS, HEADS), KVCopier(dst, LAYERS, HEADS)
    nbytes = payload_bytes(LAYERS, HEADS, 3, torch.bfloat16)
    slot = sender.device_buffer(nbytes + 120)[120:]  # a slot's payload sits behind the 120-byte header
    assert slot.device == src.device
    mirror = sender.host_buffer(nbytes)
    sender.gather_into(mirror, LAYERS, HEADS, [5, 0, 8], device_payload=slot).wait()
    assert np.array_equal(mirror, raw(slot))
    receiver.scatter_from(slot, LAYERS, HEADS, [2, 9, 4])
    assert np.array_equal(raw(dst[:, :, [2, 9, 4]]), raw(src[:, :, [5, 0, 8]]))
    back = receiver.host_buffer(nbytes)
    receiver.to_host(slot, back)
    assert np.array_equal(back, mirror)
    header = np.arange(120, dtype=np.uint8)
    target = sender.device_buffer(120)
    sender.to_device(header, target)
    assert np.array_equal(raw(target), header)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA GPU")
def test_staging_beside_a_cuda_store_is_pinned():
    copier = KVCopier(random_store("cuda", torch.float32, 8), LAYERS, HEADS)
    assert torch.from_numpy(copier.host_buffer(1 << 20)).is_pinned()
    assert copier.device_buffer(64).is_cuda


def test_staging_beside_a_cpu_store_is_plain_memory():
    copier = KVCopier(random_store("cpu", torch.float32, 8), LAYERS, HEADS)
    assert isinstance(copier.host_buffer(64), np.ndarray) and not copier.on_cuda


@pytest.mark.parametrize("device", DEVICES)
def test_what_cannot_be_copied_exactly_is_refused_and_writes_nothing(device):
    src, dst = random_store(device, torch.float32, 9), random_store(device, torch.float32, 10)
    before = raw(dst)
    sender, receiver = KVCopier(src, LAYERS, HEADS), KVCopier(dst, LAYERS, HEADS)
    buf = sender.host_buffer(payload_bytes(LAYERS, HEADS, 2, torch.float32))
    sender.gather_into(buf, LAYERS, HEADS, [3, 3]).wait()  # a source block sent twice is fine
    with pytest.raises(ValueError, match="repeat"):
        receiver.scatter_from(buf, LAYERS, HEADS, [4, 4])
    with pytest.raises(ValueError, match="bytes for a slice"):
        receiver.scatter_from(buf, LAYERS, HEADS, [4, 5, 6])
    with pytest.raises(ValueError, match="not a non-empty list"):
        receiver.scatter_from(buf, LAYERS, HEADS, [4, 10])  # block 10 of 10
    with pytest.raises(ValueError, match="not all in this store"):
        receiver.scatter_from(buf, range(2, 6), HEADS, [4, 5])  # layer 2 is another rank's
    with pytest.raises(ValueError, match="bytes for a slice"):
        sender.gather_into(buf[:-4], LAYERS, HEADS, [3, 4])
    assert np.array_equal(raw(dst), before)
    with pytest.raises(ValueError, match="does not hold"):
        KVCopier(src, range(0, 3), HEADS)


# -- agents ----------------------------------------------------------------------------------------------------

SHAPE = dict(num_layers=6, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("kv_path", ["auto", "direct"])
def test_agents_on_either_path_move_kv_byte_for_byte(kind, kv_path):
    """On the CPU "auto" is the host-staged path; "direct" runs the device-slot path with host tensors."""
    fabric = Fabric()
    # A message carries 2 blocks x 3 layers x 1 head of 4 KiB, exactly max_message_bytes: staging holds one.
    config = TransferConfig(max_message_bytes=24 << 10, staging_bytes=48 << 10, kv_path=kv_path)
    src = AgentReplica(layout_of(ParallelConfig(tp=2), **SHAPE), num_blocks=10, block_size=16, head_dim=32,
                       kind=kind, fabric=fabric, config=config, seed=11)
    dst = AgentReplica(layout_of(ParallelConfig(pp=2), **SHAPE), num_blocks=10, block_size=16, head_dim=32,
                       kind=kind, fabric=fabric, config=config, seed=12)
    try:
        want = "direct" if kv_path == "direct" else "staged"
        assert [(a.stats().device, a.stats().path) for a in src.agents + dst.agents] == [("cpu", want)] * 4
        blocks_from, blocks_to = [4, 9, 1, 6, 0, 3], [7, 2, 8, 5, 1, 0]
        desc = dst.descriptor("r/0", blocks_to, num_tokens=6 * 16, senders=src.addresses)
        src.push(dst, desc, blocks_from)
        assert dst.holds(blocks_to, src.whole[:, :, blocks_from])
        assert any(a.stats().one_off_buffers for a in src.agents)  # a second copy in flight found staging full
        for agent in src.agents + dst.agents:
            agent.release("r/0")
            wait_until(lambda: agent.stats().staging_in_use == 0, what="staging slots back")
            agent.check_integrity()
    finally:
        src.close()
        dst.close()


class AbortAfterFirstData:
    """A transport that aborts the sending agent's transfer right after the first DATA message is posted."""

    def __init__(self, inner):
        self.inner, self.agent, self.data_sent = inner, None, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, peer, tag, buffer):
        handle = self.inner.send(peer, tag, buffer)
        if split_tag(tag)[1] is Kind.DATA:
            self.data_sent += 1
            self.agent.abort("r/1", "cancelled mid-send")
        return handle


def test_a_transfer_aborted_mid_send_sends_nothing_more_and_gives_every_slot_back():
    fabric = Fabric()
    config = TransferConfig(max_message_bytes=48 << 10, staging_bytes=256 << 10)  # a block a message: 6
    src = AgentReplica(layout_of(ParallelConfig(), **SHAPE), num_blocks=10, block_size=16, head_dim=32, kind="fake",
                       fabric=fabric, config=config, seed=13, transport_wrapper=AbortAfterFirstData)
    dst = AgentReplica(layout_of(ParallelConfig(), **SHAPE), num_blocks=10, block_size=16, head_dim=32, kind="fake",
                       fabric=fabric, config=config, seed=14)
    sender = src.agents[0]
    sender.transport.agent = sender
    try:
        desc = dst.descriptor("r/1", [0, 1, 2, 3, 4, 5], num_tokens=96, senders=src.addresses)
        sender.arm(desc)
        sender.send_all("r/1", [5, 4, 3, 2, 1, 0])
        assert sender.transport.data_sent == 1  # the copy already started for the next message is dropped
        wait_until(lambda: dst.states("r/1")[0].state is TransferState.ABORTED, what="the receiver to learn it")
        wait_until(lambda: sender.stats().staging_in_use == 0, what="staging slots back")
        sender.check_integrity()
    finally:
        src.close()
        dst.close()


def test_repeated_destination_blocks_are_refused_at_reservation():
    fabric = Fabric()
    layout = layout_of(ParallelConfig(), **SHAPE)
    cache = PagedKVCache(KVCacheSpec(6, 4, 16, 2, 32, torch.float32))
    agent = KVTransferAgent(cache, layout, 0, FakeTransport(fabric))
    try:
        with pytest.raises(ValueError, match="repeat"):
            agent.expect("r/2", [1, 2, 1], time.time() + 30)
        assert agent.poll() == {}
    finally:
        agent.close()


def test_ucx_reports_no_cuda_transport_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: UCX may report CUDA transports")
    assert cuda_transports() == ()


def test_cuda_transports_are_read_off_the_ucx_resource_list():
    info = "\n".join(f"#      resource {i}  :  md {i}  dev {i}  flags -- {r}" for i, r in enumerate(
        ["self/memory", "tcp/lo", "cuda_copy/cuda", "cuda_ipc/cuda", "gdr_copy/gdr_copy", "rc_mlx5/mlx5_0:1",
         "rc_mlx5/mlx5_1:1", "dc_mlx5/mlx5_0:1"]))
    assert cuda_transports(info, gpudirect=False) == ("cuda_copy", "cuda_ipc", "gdr_copy")
    assert cuda_transports(info, gpudirect=True) == ("cuda_copy", "cuda_ipc", "gdr_copy", "rc_mlx5", "dc_mlx5")
    assert between_processes(("cuda_copy", "gdr_copy")) == ()  # UCX would only stage through host memory
    assert between_processes(("cuda_copy", "cuda_ipc")) == ("cuda_ipc",)


# -- two processes ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device, kv_path, shared", [
    ("cpu", "auto", ""),
    ("cpu", "auto", "staging"),
    ("cpu", "auto", "store"),
    ("cpu", "direct", ""),
    pytest.param("cuda", "staged", "", marks=GPU),
    pytest.param("cuda", "auto", "", marks=GPU),  # direct where UCX moves device memory between processes
], ids=["cpu-staged", "cpu-shared-staging", "cpu-shared-store", "cpu-direct", "cuda-staged", "cuda-auto"])
def test_two_processes_move_kv_byte_for_byte(device, kv_path, shared):
    """A sender and a receiver process over UCX, KV stores on `device` (bfloat16 random bytes): a transfer
    sent at once, one sent layer by layer and one between runs of consecutive blocks arrive exactly; no other
    block changes. shared: the descriptors name the receiver's shared-memory domain, so payloads go by
    reference (some still with their payload: the sender's staging holds one message); "store": the sender's
    KV store is shared too, so the run of blocks is read from it directly."""
    sides = []
    try:
        spec = ProcessSide(device, kv_path, num_blocks=24, share_kv_store=shared == "store")
        sides.append(SideProcess(dataclasses.replace(spec, seed=21)))
        sides.append(SideProcess(dataclasses.replace(spec, seed=22)))
        sender, receiver = sides
        for side in sides:
            direct = kv_path == "direct" or (kv_path == "auto" and device == "cuda" and
                                             bool(between_processes(side.cuda_transports)))
            assert side.stats.path == ("direct" if direct else "staged"), side.cuda_transports
            assert side.stats.device.startswith(device)
        before = receiver.ask("bytes", "bytes")[1]
        transfers = {"all/0": ("send_all", [9, 2, 7, 0, 11, 4, 1, 5], [3, 10, 0, 6, 1, 8, 11, 2]),
                     "layers/0": ("layer_by_layer", [13, 6, 15], [14, 4, 12]),
                     "run/0": ("send_all", [16, 17, 18, 19], [19, 20, 21, 22])}
        domains = (receiver.shm_domain,) if shared else ()
        for transfer_id, (how, blocks_from, blocks_to) in transfers.items():
            deadline = time.time() + 60
            receiver.ask("ok", "expect", transfer_id, blocks_to, deadline, (sender.address,))
            desc = TransferDescriptor(transfer_id, spec.layout(), (receiver.address,), tuple(blocks_to),
                                      len(blocks_to) * spec.block_size, spec.format(), deadline, domains)
            sender.ask("ok", how, desc, blocks_from)
            for side in (receiver, sender):
                status = side.ask("ended", "wait", transfer_id)[1]
                assert status.state is TransferState.DONE, status
        sent, got = sender.ask("bytes", "bytes")[1], receiver.ask("bytes", "bytes")[1]
        moved = set()
        for how, blocks_from, blocks_to in transfers.values():
            assert np.array_equal(got[:, :, blocks_to], sent[:, :, blocks_from]), how
            moved |= set(blocks_to)
        others = [b for b in range(spec.num_blocks) if b not in moved]
        assert np.array_equal(got[:, :, others], before[:, :, others])
        for side in sides:
            for transfer_id in transfers:
                stats = side.ask("released", "release", transfer_id)[1]
                assert stats.staging_in_use == 0
        stats = sender.ask("released", "release", "all/0")[1]
        if shared:
            assert sender.stats.shared_memory == "on" and receiver.shm_domain, sender.stats
            assert stats.by_reference > stats.from_store
        else:
            assert stats.by_reference == 0
        assert (stats.from_store > 0) == (shared == "store")  # only the run of blocks: "run/0"
    finally:
        for side in sides:
            side.close()
