"""The transfer agent's pump (kv_transfer/agent.py): while a transfer is open and nothing moves, it waits longer
between turns, up to idle_poll_s, instead of turning every 0.2 ms (a long prompt's prefill keeps its transfer open
for seconds, and those turns took the pinned cores that the prefill and decode steps run on: docs/BENCHMARKS.md,
issue 52); a transfer that then starts still completes."""

from __future__ import annotations

import time

import torch

from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer.agent import FIRST_WAIT_S
from tandem.kv_transfer.fake_transport import Fabric
from tests.kv_transfer.kv_helpers import AgentReplica, layout_of

SHAPE = dict(num_layers=2, num_heads=2, num_kv_heads=1)


def test_an_open_transfer_that_nothing_moves_lets_the_pump_back_off_and_a_late_push_still_lands():
    fabric = Fabric()
    layout = layout_of(ParallelConfig(), **SHAPE)
    src = AgentReplica(layout, num_blocks=8, block_size=4, head_dim=8, kind="fake", fabric=fabric, seed=1)
    dst = AgentReplica(layout, num_blocks=8, block_size=4, head_dim=8, kind="fake", fabric=fabric, seed=2)
    try:
        agent = dst.agents[0]
        turns = []
        turn = agent._turn
        agent._turn = lambda: turns.append(time.monotonic()) or turn()
        desc = dst.descriptor("open", [0, 1], 8, senders=src.addresses)
        time.sleep(0.6)
        window = [t for t in turns if t > turns[-1] - 0.4]  # past the ramp: the last 0.4 s
        idle = agent.config.idle_poll_s
        assert 0.4 / (4 * idle) < len(window) < 0.4 / idle * 1.5, len(window)  # turning every 0.2 ms: ~2000
        assert 0.4 / FIRST_WAIT_S > 10 * len(window)
        src.push(dst, desc, [0, 1])  # the backed-off pump still takes the data in
        assert dst.holds([0, 1], src.whole.index_select(2, torch.tensor([0, 1])))
    finally:
        src.close()
        dst.close()
