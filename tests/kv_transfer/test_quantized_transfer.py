"""Quantized KV pages (int8 / fp8_e4m3 codes with their per-block scales) move between agents as they are, at
about half the bytes of bfloat16; replicas whose KV dtypes differ exchange KV too, the receiver converting what
arrives (engine/attention/kv_quant.py convert_blocks)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention.kv_quant import convert_blocks, scales_of
from tandem.engine.kv.kv_cache import KV_STORAGE
from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat
from tandem.kv_transfer.fake_transport import Fabric
from tests.kv_transfer.kv_helpers import AgentReplica, layout_of

SHAPE = dict(num_layers=4, num_heads=6, num_kv_heads=3)
SRC_BLOCKS, DST_BLOCKS = [5, 2, 7], [1, 8, 3]
BLOCK, HEAD_DIM = 16, 64


def _move(src_dtype: str, dst_dtype: str, shared: bool, src_cfg=ParallelConfig(tp=3), dst_cfg=ParallelConfig(pp=2)):
    fabric = Fabric()
    config = TransferConfig(max_message_bytes=1 << 16, staging_bytes=4 << 20, shared_memory=True)
    src = AgentReplica(layout_of(src_cfg, **SHAPE), num_blocks=10, block_size=BLOCK, head_dim=HEAD_DIM, kind="fake",
                       fabric=fabric, config=config, seed=1, dtype=src_dtype)
    dst = AgentReplica(layout_of(dst_cfg, **SHAPE), num_blocks=10, block_size=BLOCK, head_dim=HEAD_DIM, kind="fake",
                       fabric=fabric, config=config, seed=2, dtype=dst_dtype)
    try:
        desc = dst.descriptor("req", DST_BLOCKS, num_tokens=3 * BLOCK - 5, senders=src.addresses,
                              shared_memory=shared)
        src.push(dst, desc, SRC_BLOCKS)
        moved = sum(s.nbytes for s in dst.states("req"))
        for agent in src.agents + dst.agents:
            agent.release("req")
            agent.check_integrity()
        return src, dst, moved
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("shared", [False, True], ids=["payloads", "by-reference"])
@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_quantized_pages_and_their_scales_move_bit_for_bit_at_half_the_bytes_of_bfloat16(dtype, shared):
    src, dst, moved = _move(dtype, dtype, shared)
    assert dst.holds(DST_BLOCKS, src.whole[:, :, SRC_BLOCKS])
    # The scales travelled with the codes: they are the data's, not 1.
    scales = scales_of(dst.agents[0].kv.data[:, :, DST_BLOCKS])
    assert (scales > 0).all() and not torch.isclose(scales, torch.ones_like(scales)).any()
    fmt = KVFormat(SHAPE["num_layers"], SHAPE["num_kv_heads"], HEAD_DIM, BLOCK, dtype)
    assert moved == SHAPE["num_layers"] * SHAPE["num_kv_heads"] * len(SRC_BLOCKS) * fmt.bytes_per_block_layer_head
    bf16 = fmt.with_dtype("bfloat16").bytes_per_block_layer_head
    assert fmt.bytes_per_block_layer_head / bf16 == (BLOCK + 1) / (2 * BLOCK)  # codes, plus one scale row a block
    assert fmt.bytes_per_block_layer_head / fmt.with_dtype("float32").bytes_per_block_layer_head == (BLOCK + 1) / (
        4 * BLOCK)


@pytest.mark.parametrize("shared", [False, True], ids=["payloads", "by-reference"])
@pytest.mark.parametrize("pair", [("bfloat16", "int8"), ("int8", "bfloat16"), ("float32", "fp8_e4m3"),
                                  ("int8", "fp8_e4m3"), ("fp8_e4m3", "float32")])
def test_a_receiver_of_another_kv_dtype_converts_what_arrives(pair, shared):
    src_dtype, dst_dtype = pair
    src, dst, moved = _move(src_dtype, dst_dtype, shared)
    sent = src.whole[:, :, SRC_BLOCKS]
    assert dst.holds(DST_BLOCKS, convert_blocks(sent, BLOCK, KV_STORAGE[dst_dtype]))
    # The wire carried the sender's format: its bytes, not the receiver's.
    fmt = KVFormat(SHAPE["num_layers"], SHAPE["num_kv_heads"], HEAD_DIM, BLOCK, src_dtype)
    assert moved == SHAPE["num_layers"] * SHAPE["num_kv_heads"] * len(SRC_BLOCKS) * fmt.bytes_per_block_layer_head
    # And the values are the sender's, to the precision of the coarser dtype.
    def values(blocks):
        return convert_blocks(blocks, BLOCK, torch.float32)

    received = torch.cat([values(a.kv.data[:, :, DST_BLOCKS]) for a in dst.agents])  # pp=2: stages in layer order
    error = (received - values(sent)).abs().max().item()
    bound = {"int8": 0.03, "fp8_e4m3": 0.3, "bfloat16": 0.02, "float32": 0.0}
    assert error <= max(bound[src_dtype], bound[dst_dtype])


def test_the_receiver_takes_messages_of_a_wider_sender_than_itself():
    """An int8 decode store takes float32 messages: its reservation leaves room for the widest dtype."""
    fmt = KVFormat(4, 3, HEAD_DIM, BLOCK, "int8")
    assert fmt.largest_bytes_per_block_layer_head == fmt.with_dtype("float32").bytes_per_block_layer_head
    with pytest.raises(ValueError, match="unknown KV dtype"):
        fmt.with_dtype("int4")
    with pytest.raises(ValueError, match="block_size"):
        fmt.check_matches(KVFormat(4, 3, HEAD_DIM, 32, "int8"), dtype=False)
    fmt.check_matches(fmt.with_dtype("bfloat16"), dtype=False)
    with pytest.raises(ValueError, match="dtype"):
        fmt.check_matches(fmt.with_dtype("bfloat16"))
