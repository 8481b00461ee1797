"""The transfer plan: every destination rank receives exactly its layers x KV heads, each cell once, from a
source rank that holds it; messages cut at layer groups and size limits."""

from __future__ import annotations

import itertools

import pytest

from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer.plan import MAX_MESSAGES, Piece, plan_messages, plan_pieces
from tests.kv_transfer.kv_helpers import layout_of

EMBEDDED = dict(num_layers=30, num_heads=9, num_kv_heads=3)  # SmolLM2-135M
MOE = dict(num_layers=6, num_heads=8, num_kv_heads=4, num_experts=8)


def check_covers(src, dst, pieces: tuple[Piece, ...]) -> None:
    got: dict[int, list[tuple[int, int]]] = {}
    for p in pieces:
        held = src.shard(p.src_rank)
        assert set(p.layers) <= set(held.layers) and set(p.kv_heads) <= set(held.kv_heads), p
        got.setdefault(p.dst_rank, []).extend(itertools.product(p.layers, p.kv_heads))
    for d in range(dst.world_size):
        shard = dst.shard(d)
        cells = got.get(d, [])
        assert len(cells) == len(set(cells)), f"rank {d} gets a cell twice"
        assert set(cells) == set(itertools.product(shard.layers, shard.kv_heads)), f"rank {d} misses cells"


@pytest.mark.parametrize("src, dst, shape", [
    (ParallelConfig(tp=2), ParallelConfig(pp=2), EMBEDDED),
    (ParallelConfig(tp=3), ParallelConfig(pp=2, tp=1), EMBEDDED),
    (ParallelConfig(tp=1), ParallelConfig(ep=2, pp=2), MOE),
    (ParallelConfig(tp=2, pp=2), ParallelConfig(tp=3), EMBEDDED),
    (ParallelConfig(tp=9), ParallelConfig(tp=2, pp=3), EMBEDDED),  # KV heads replicated on the source
    (ParallelConfig(ep=2, tp=2), ParallelConfig(pp=3, ep=2), MOE),
], ids=lambda v: v if isinstance(v, str) else None)
def test_named_layout_pairs_cover_every_destination_cell_once(src, dst, shape):
    s = layout_of(src, **shape)
    d = layout_of(dst, **shape)
    pieces = plan_pieces(s, d)
    check_covers(s, d, pieces)


def test_tp2_to_pp2_on_the_embedded_shape_is_two_pieces_per_stage():
    s, d = layout_of(ParallelConfig(tp=2), **EMBEDDED), layout_of(ParallelConfig(pp=2), **EMBEDDED)
    assert plan_pieces(s, d) == (Piece(0, 0, range(0, 15), range(0, 2)), Piece(1, 0, range(0, 15), range(2, 3)),
                                 Piece(0, 1, range(15, 30), range(0, 2)), Piece(1, 1, range(15, 30), range(2, 3)))


def test_every_valid_pair_of_small_layouts_is_covered():
    shapes = [dict(num_layers=5, num_heads=6, num_kv_heads=3, num_experts=4),
              dict(num_layers=4, num_heads=8, num_kv_heads=2, num_experts=4)]
    for shape in shapes:
        layouts = []
        for tp, pp, ep in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2)):
            try:
                layouts.append(layout_of(ParallelConfig(tp=tp, pp=pp, ep=ep), **shape))
            except ValueError:
                continue  # a split this model cannot take
        assert len(layouts) >= 12
        for s, d in itertools.product(layouts, repeat=2):
            check_covers(s, d, plan_pieces(s, d))


def test_replicas_of_a_source_slice_share_the_sending():
    shape = MOE
    s, d = layout_of(ParallelConfig(ep=2), **shape), layout_of(ParallelConfig(tp=2), **shape)
    assert {p.src_rank for p in plan_pieces(s, d)} == {0, 1}


def test_layouts_of_different_models_are_refused():
    with pytest.raises(ValueError, match="different shapes"):
        plan_pieces(layout_of(ParallelConfig(), **EMBEDDED), layout_of(ParallelConfig(), **MOE))


def test_messages_cut_at_layer_groups_and_size():
    s, d = layout_of(ParallelConfig(tp=2), **EMBEDDED), layout_of(ParallelConfig(pp=2), **EMBEDDED)
    pieces = plan_pieces(s, d)
    per = 2 * 16 * 64 * 4  # K and V of one block, layer and head (float32)
    whole = plan_messages(pieces, 32, layer_group=30, max_message_bytes=1 << 30, bytes_per_block_layer_head=per)
    assert len(whole) == 4  # one per rank pair
    layered = plan_messages(pieces, 32, layer_group=1, max_message_bytes=1 << 30, bytes_per_block_layer_head=per)
    assert len(layered) == 2 * 30 and all(len(m.layers) == 1 for m in layered)
    grouped = plan_messages(pieces, 32, layer_group=4, max_message_bytes=1 << 30, bytes_per_block_layer_head=per)
    assert all(m.layers.start // 4 == (m.layers.stop - 1) // 4 for m in grouped)  # never across a group edge
    small = plan_messages(pieces, 32, layer_group=30, max_message_bytes=15 * 2 * per * 10,
                          bytes_per_block_layer_head=per)
    assert all(m.nbytes(per) <= 15 * 2 * per * 10 for m in small)
    assert {len(m.blocks) for m in small} == {10, 20, 2, 12}  # 2-head pieces: 10+10+10+2; 1-head: 20+12
    for msgs in (whole, layered, grouped, small):  # same cells, each block once
        cells = [(m.dst_rank, layer, head, b) for m in msgs for layer in m.layers for head in m.kv_heads
                 for b in m.blocks]
        assert len(cells) == len(set(cells)) == 30 * 3 * 32
        assert [m.index for m in msgs] == list(range(len(msgs)))


def test_impossible_message_limits_are_refused():
    s, d = layout_of(ParallelConfig(), **EMBEDDED), layout_of(ParallelConfig(), **EMBEDDED)
    pieces = plan_pieces(s, d)
    with pytest.raises(ValueError, match="max_message_bytes"):
        plan_messages(pieces, 4, layer_group=30, max_message_bytes=1000, bytes_per_block_layer_head=8192)
    with pytest.raises(ValueError, match=str(MAX_MESSAGES)):
        plan_messages(pieces, 5000, layer_group=1, max_message_bytes=3 * 8192, bytes_per_block_layer_head=8192)
