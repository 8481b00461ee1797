"""ReplicaLayout: which rank holds which layers, heads and experts (plain Python, no processes)."""

from __future__ import annotations

import pytest

from tandem.engine.parallel import ParallelConfig, ReplicaLayout, split_evenly
from tandem.engine.runner.model_runner import split_micro_batches

SMOLLM2 = dict(num_layers=30, num_heads=9, num_kv_heads=3)


def layout(tp=1, pp=1, ep=1, **kw) -> ReplicaLayout:
    model = SMOLLM2 | {k: kw.pop(k) for k in list(kw) if k in ("num_layers", "num_heads", "num_kv_heads",
                                                                "num_experts")}
    return ReplicaLayout.build(ParallelConfig(tp=tp, pp=pp, ep=ep, **kw), **model)


def test_split_evenly_gives_larger_parts_first_and_covers_everything():
    assert split_evenly(9, 2) == (range(0, 5), range(5, 9))
    assert split_evenly(2, 4) == (range(0, 1), range(1, 2), range(2, 2), range(2, 2))


def test_smollm2_tp2_splits_by_kv_head_groups_unevenly():
    lay = layout(tp=2)
    assert [lay.heads(t) for t in range(2)] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]


def test_tp3_gives_each_rank_one_kv_head_and_its_three_query_heads():
    lay = layout(tp=3)
    assert [lay.heads(t) for t in range(3)] == [(range(3 * t, 3 * t + 3), range(t, t + 1)) for t in range(3)]


def test_tp_beyond_kv_heads_replicates_kv_heads_when_query_heads_split_evenly_over_them():
    lay = layout(tp=9)
    assert lay.heads(4) == (range(4, 5), range(1, 2))
    assert layout(tp=4).heads(2) == (range(5, 7), range(1, 3))  # one query head on each of KV heads 1 and 2
    with pytest.raises(ValueError, match="unequally"):
        layout(tp=3, num_heads=8, num_kv_heads=2)  # rank 1: query heads 3-5 read KV head 0 once, KV head 1 twice
    with pytest.raises(ValueError, match="attention heads"):
        layout(tp=10)


def test_pipeline_stages_are_even_by_default_or_explicit():
    assert layout(pp=4).stage_layers == (range(0, 8), range(8, 16), range(16, 23), range(23, 30))
    assert layout(pp=2, stage_layers=(10, 20)).stage_layers == (range(0, 10), range(10, 30))
    with pytest.raises(ValueError, match="summing to"):
        layout(pp=2, stage_layers=(10, 10))
    with pytest.raises(ValueError, match="layers"):
        layout(pp=31)


def test_experts_are_contiguous_by_default_or_follow_an_explicit_map():
    lay = layout(ep=4, num_experts=8)
    assert [lay.experts(e) for e in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    mapped = layout(ep=2, num_experts=4, expert_ranks=(1, 0, 1, 0))
    assert mapped.experts(0) == (1, 3) and mapped.experts(1) == (0, 2)
    with pytest.raises(ValueError, match="without experts"):
        layout(ep=2, num_experts=4, expert_ranks=(0, 0, 0, 0))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        layout(ep=2)


def test_ranks_map_to_coordinates_and_back_and_groups_are_consistent():
    lay = layout(tp=2, pp=2, ep=2, num_experts=8)
    assert lay.world_size == 8
    for rank in range(8):
        stage, e, t = lay.coords(rank)
        assert lay.rank(stage, e, t) == rank
        shard = lay.shard(rank)
        assert shard.layers == lay.stage_layers[stage] and shard.experts == lay.experts(e)
        assert rank in lay.tp_group(stage, e) and rank in lay.ep_group(stage, t)
    assert lay.sampler_rank == lay.rank(1, 0, 0) == 4
    assert lay.shard(4).is_last_stage and not lay.shard(4).is_first_stage
    assert len(lay.describe()) == 8
    with pytest.raises(ValueError, match="outside"):
        lay.coords(8)


def test_parallel_config_rejects_nonsense():
    for bad in (dict(tp=0), dict(pp=-1), dict(micro_batches=0), dict(collective_timeout_s=0)):
        with pytest.raises(ValueError):
            ParallelConfig(**bad)
    assert ParallelConfig(pp=3).num_micro_batches == 6 and ParallelConfig().num_micro_batches == 1


def test_micro_batches_are_contiguous_nonempty_and_balanced_by_tokens():
    assert split_micro_batches([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_micro_batches([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert split_micro_batches([1, 1], 6) == [range(0, 1), range(1, 2)]
    for counts in ([5, 1, 7, 2, 2, 9, 1], [1] * 13, [30]):
        for parts in (1, 2, 3, 4):
            runs = split_micro_batches(counts, parts)
            assert [i for r in runs for i in r] == list(range(len(counts)))
            assert all(len(r) for r in runs) and len(runs) == min(parts, len(counts))
