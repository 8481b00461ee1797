"""Agents of two replicas of different layouts move a request's KV: each destination rank ends up with exactly
its layers x KV heads of the source blocks, bit for bit, over real UCX on loopback and over the fake."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferState
from tandem.kv_transfer.fake_transport import Fabric
from tests.kv_transfer.kv_helpers import TRANSPORTS, AgentReplica, layout_of, wait_until

EMBEDDED = dict(num_layers=30, num_heads=9, num_kv_heads=3)  # SmolLM2-135M: 3 KV heads of 64
MOE = dict(num_layers=6, num_heads=8, num_kv_heads=4, num_experts=8)
PAIRS = [
    (ParallelConfig(tp=2), ParallelConfig(pp=2), EMBEDDED),
    (ParallelConfig(tp=3), ParallelConfig(pp=2, tp=1), EMBEDDED),
    (ParallelConfig(tp=1), ParallelConfig(ep=2, pp=2), MOE),
    (ParallelConfig(tp=2, pp=2), ParallelConfig(tp=3), EMBEDDED),
    (ParallelConfig(pp=3), ParallelConfig(tp=2, pp=2), EMBEDDED),
    (ParallelConfig(tp=2, ep=2), ParallelConfig(pp=3), MOE),
]
SRC_BLOCKS, DST_BLOCKS = [5, 2, 7, 0, 9], [1, 8, 3, 4, 6]  # scattered, different ids on each side


def label(pair) -> str:
    src, dst, shape = pair
    name = lambda p: f"tp{p.tp}pp{p.pp}ep{p.ep}"  # noqa: E731
    return f"{name(src)}-to-{name(dst)}-{'moe' if shape is MOE else 'smollm2'}"


@pytest.mark.parametrize("shared", [False, True], ids=["payloads", "by-reference"])
@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("pair", PAIRS, ids=[label(p) for p in PAIRS])
def test_every_destination_rank_gets_exactly_its_share(pair, kind, shared):
    """shared: the descriptor names the destination ranks' shared-memory domains (payloads by reference)."""
    if shared and kind == "ucx":
        pytest.skip("by reference over UCX runs in child processes here (test_device_copy): one full-suite run "
                    "crashed (SIGSEGV) in this in-process case, under investigation (issue 23 note)")
    src_cfg, dst_cfg, shape = pair
    fabric = Fabric()
    config = TransferConfig(max_message_bytes=1 << 20, staging_bytes=8 << 20,  # several messages per piece
                            shared_memory=True)
    src = AgentReplica(layout_of(src_cfg, **shape), num_blocks=10, block_size=16, head_dim=64, kind=kind,
                       fabric=fabric, config=config, seed=1)
    dst = AgentReplica(layout_of(dst_cfg, **shape), num_blocks=10, block_size=16, head_dim=64, kind=kind,
                       fabric=fabric, config=config, seed=2)
    try:
        before = dst.whole.clone()
        desc = dst.descriptor("req-1/0", DST_BLOCKS, num_tokens=5 * 16 - 3, senders=src.addresses,
                              shared_memory=shared)
        src.push(dst, desc, SRC_BLOCKS)
        assert dst.holds(DST_BLOCKS, src.whole[:, :, SRC_BLOCKS])
        untouched = [b for b in range(10) if b not in DST_BLOCKS]
        assert dst.holds(untouched, before[:, :, untouched])
        moved = sum(s.nbytes for s in dst.states("req-1/0"))
        assert moved == shape["num_layers"] * shape["num_kv_heads"] * 5 * 2 * 16 * 64 * 4 * _replicas(dst.layout)
        assert (sum(a.stats().by_reference for a in src.agents) > 0) == shared
        sent, received = (sum(a.stats().bytes_sent for a in src.agents),
                          sum(a.stats().bytes_received for a in dst.agents))
        assert sent == received == moved, (sent, received, moved)
        for agent in src.agents + dst.agents:
            agent.release("req-1/0")
            agent.check_integrity()
    finally:
        src.close()
        dst.close()


def _replicas(layout) -> int:
    """How many ranks hold each (layer, KV head) of a layout: EP copies, KV heads replicated past tp."""
    copies = layout.ep
    if layout.tp > layout.num_kv_heads:
        copies *= layout.tp // layout.num_kv_heads
    return copies


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_layers_leave_as_they_are_computed(kind):
    """With layer_group=1 a layer is on the wire once the runner reports it, and not before."""
    fabric = Fabric()
    src = AgentReplica(layout_of(ParallelConfig(tp=2), **EMBEDDED), num_blocks=10, block_size=16, head_dim=64,
                       kind=kind, fabric=fabric, seed=3)
    dst = AgentReplica(layout_of(ParallelConfig(pp=2), **EMBEDDED), num_blocks=10, block_size=16, head_dim=64,
                       kind=kind, fabric=fabric, seed=4)
    try:
        desc = dst.descriptor("req-2/0", DST_BLOCKS, num_tokens=80, senders=src.addresses)
        for agent in src.agents:
            agent.arm(desc, seq_id="req-2#0")
        for layer in range(10):  # the first 10 layers are computed on both TP ranks
            for agent in src.agents:
                agent.on_layers_done(layer, {"req-2#0": tuple(SRC_BLOCKS), "other#0": (3,)})
        stage0 = dst.agents[0]
        per_layer = 3 * 5 * 2 * 16 * 64 * 4
        wait_until(lambda: stage0.poll(["req-2/0"])["req-2/0"].nbytes == 10 * per_layer, what="10 layers")
        assert dst.states("req-2/0")[1].nbytes == 0  # stage 1 holds layers 15-29: nothing sent yet
        rows = torch.tensor(DST_BLOCKS)
        assert torch.equal(stage0.kv.data[:10].index_select(2, rows), src.whole[:10, :, SRC_BLOCKS])
        assert [s.state for s in dst.states("req-2/0")] == [TransferState.TRANSFERRING, TransferState.RESERVED]
        for layer in range(10, 30):
            for agent in src.agents:
                agent.on_layers_done(layer, {"req-2#0": tuple(SRC_BLOCKS)})
        wait_until(lambda: all(s.state is TransferState.DONE for s in dst.states("req-2/0") + src.states("req-2/0")),
                   what="both sides DONE")
        assert dst.holds(DST_BLOCKS, src.whole[:, :, SRC_BLOCKS])
    finally:
        src.close()
        dst.close()
