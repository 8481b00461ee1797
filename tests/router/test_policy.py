"""The order in which the router tries a pool's replicas, for each routing policy of the manifest."""

from __future__ import annotations

import random

import pytest

from tandem.router.policy import ReplicaLoad, ReplicaPicker


def order(picker: ReplicaPicker, pool) -> list[ReplicaLoad]:
    """Every replica of the pool, best first, with no cached prefix anywhere (load alone)."""
    return list(picker.rank_prefill(pool, {}, block_size=16))


def _names(replicas) -> list[str]:
    return [r.name for r in replicas]


def _pool(*in_flight: int, refusals: dict[str, int] | None = None) -> list[ReplicaLoad]:
    refusals = refusals or {}
    names = "abcdefgh"[:len(in_flight)]
    return [ReplicaLoad(name, n, refusals.get(name, 0)) for name, n in zip(names, in_flight)]


def test_least_loaded_orders_by_requests_in_flight():
    picker = ReplicaPicker("least_loaded")
    assert _names(order(picker, _pool(5, 0, 3, 1))) == ["b", "d", "c", "a"]


def test_least_loaded_keeps_the_pool_order_among_equals_and_is_the_default():
    picker = ReplicaPicker()
    pool = _pool(2, 1, 2, 1)
    assert _names(order(picker, pool)) == ["b", "d", "a", "c"]
    assert _names(order(picker, pool)) == ["b", "d", "a", "c"], "no rotation: the same loads give the same order"


def test_least_loaded_follows_the_counters_as_they_change():
    picker = ReplicaPicker("least_loaded")
    pool = _pool(0, 0, 0)
    first = order(picker, pool)[0]
    first.in_flight += 1
    second = order(picker, pool)[0]
    second.in_flight += 1
    third = order(picker, pool)[0]
    assert _names([first, second, third]) == ["a", "b", "c"]


def test_round_robin_rotates_the_first_replica_over_calls():
    picker = ReplicaPicker("round_robin")
    pool = _pool(9, 0, 4)  # loads do not matter
    orders = [_names(order(picker, pool)) for _ in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_round_robin_spreads_requests_evenly():
    picker = ReplicaPicker("round_robin")
    pool = _pool(0, 0, 0, 0)
    firsts = [order(picker, pool)[0].name for _ in range(100)]
    assert {name: firsts.count(name) for name in "abcd"} == {"a": 25, "b": 25, "c": 25, "d": 25}


def test_random_with_a_seeded_rng_gives_every_replica_once_and_repeats_with_the_seed():
    pool = _pool(0, 3, 1, 7, 2)
    picker = ReplicaPicker("random", rng=random.Random(7))
    orders = [_names(order(picker, pool)) for _ in range(30)]
    for ranked in orders:
        assert sorted(ranked) == ["a", "b", "c", "d", "e"]
    assert len({ranked[0] for ranked in orders}) > 1, "the first choice varies"
    again = ReplicaPicker("random", rng=random.Random(7))
    assert [_names(order(again, pool)) for _ in range(30)] == orders


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin", "random"])
def test_replicas_that_refused_go_last_in_every_policy(policy):
    pool = _pool(0, 4, 1, 2, 3, refusals={"a": 1, "c": 2})
    refused = {"a", "c"}
    base = ReplicaPicker(policy, rng=random.Random(3))
    with_refusals = ReplicaPicker(policy, rng=random.Random(3))
    for _ in range(6):
        plain_order = _names(order(base, [ReplicaLoad(r.name, r.in_flight) for r in pool]))
        ranked = _names(order(with_refusals, pool))
        assert set(ranked[-2:]) == refused, ranked
        # Otherwise the policy's own order: the same as with no refusals, refused replicas moved to the end.
        assert ranked == [n for n in plain_order if n not in refused] + [n for n in plain_order if n in refused]


def test_refusals_last_in_least_loaded_even_when_idle():
    picker = ReplicaPicker("least_loaded")
    pool = _pool(0, 5, 3, refusals={"a": 1})
    assert _names(order(picker, pool)) == ["c", "b", "a"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        ReplicaPicker("fastest")


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin", "random"])
def test_an_empty_pool_gives_an_empty_order(policy):
    assert order(ReplicaPicker(policy), []) == []


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin", "random"])
def test_a_single_replica_is_always_first(policy):
    picker = ReplicaPicker(policy, rng=random.Random(0))
    only = ReplicaLoad("only", in_flight=3, refusals=2)
    assert [order(picker, [only]) for _ in range(3)] == [[only]] * 3


def test_cache_aware_trades_a_cached_prefix_against_queued_work():
    picker = ReplicaPicker("cache_aware")  # defaults: a cached token saves 1, a queued token costs 0.5
    pool = [ReplicaLoad("a", queued_prefill_tokens=600), ReplicaLoad("b", queued_prefill_tokens=0)]
    # "a" holds 40 blocks (640 tokens) of the prompt: 0.5 * 600 - 640 < 0, so it wins despite its queue
    assert _names(picker.rank_prefill(pool, {"a": 40}, block_size=16)) == ["a", "b"]
    pool[0].queued_prefill_tokens = 1400  # 0.5 * 1400 - 640 > 0: now the cold, idle replica is faster
    assert _names(picker.rank_prefill(pool, {"a": 40}, block_size=16)) == ["b", "a"]


def test_cache_aware_spreads_new_prefixes_over_an_idle_pool_by_cache_size():
    picker = ReplicaPicker("cache_aware")
    pool = [ReplicaLoad(name) for name in "abc"]
    cached = {"a": 30, "b": 2, "c": 9}
    assert next(picker.rank_prefill(pool, {}, block_size=16, cached_blocks=cached.__getitem__)).name == "b"


def test_cache_aware_decode_prefers_free_blocks_against_sequences_in_flight():
    picker = ReplicaPicker("cache_aware")  # a sequence in flight weighs 16 free blocks
    pool = [ReplicaLoad("a", in_flight=4, kv_blocks_free=500), ReplicaLoad("b", in_flight=0, kv_blocks_free=450),
            ReplicaLoad("c", in_flight=0, kv_blocks_free=None)]  # never polled: counted as no free blocks
    assert _names(picker.rank_decode(pool)) == ["b", "a", "c"]
    pool[1].refusals = 1
    assert _names(picker.rank_decode(pool)) == ["a", "c", "b"]
