"""Routing over the mock engine (router/mocks/replicas.py) with 3-4 replicas per pool: the real request
driver, routing, prefix index and KV feed, with replicas whose prefix caches hash and publish events as the
engine's do. The feed is polled by hand between requests, so every test is deterministic."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.engine.core.kv_tiers import TierHitCosts
from tandem.engine.kv.kv_events import KVEventLog, KVSnapshot
from tandem.engine.kv.prefix_cache import block_hashes
from tandem.replica.contract import KVEventsReply
from tandem.engine.sampling_params import SamplingParams
from tandem.router.auth import cache_salt_for
from tandem.router.driver_settings import DriverSettings
from tandem.router.kv_feed import KVFeed
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tandem.router.replicas import Replica, ReplicaPools
from tandem.router.request_parsing import ParsedRequest
from tandem.router.policy import ReplicaLoad
from tandem.router.prefix_pulls import PrefixPulls
from tandem.router.routing import Routing, RoutingSettings

SYSTEM = {g: tuple(range(1000 * g, 1000 * g + 160)) for g in range(4)}  # 4 system prompts of 10 blocks


def prompt(group: int, i: int) -> tuple[int, ...]:
    return SYSTEM[group] + (50_000 + i, 50_001 + i, 50_002 + i)


def make(prefill, decode, **routing) -> RequestDriver:
    settings = DriverSettings(routing=RoutingSettings(**routing))
    return RequestDriver([Replica(p.name, "prefill", p) for p in prefill],
                         [Replica(d.name, "decode", d) for d in decode], settings, block_size=16)


async def send(d: RequestDriver, request_id: str, tokens, *, tenant=None, session="", max_tokens=2):
    request = ParsedRequest(request_id, tuple(tokens), SamplingParams(max_tokens=max_tokens, temperature=0), 0,
                            session, cache_salt_for(tenant))
    return [p async for p in d.run(request)]


def where(progress) -> tuple[str, str, str]:
    return progress[0].prefill_replica, progress[0].decode_replica, progress[0].prefill_route


def pools(n_prefill=3, n_decode=3, **kwargs):
    return ([MockPrefill(f"prefill-{i}", **kwargs) for i in range(n_prefill)],
            [MockDecode(f"decode-{i}") for i in range(n_decode)])


def test_a_shared_prefix_lands_on_the_replica_that_holds_it():
    prefill, decode = pools()

    async def scenario():
        d = make(prefill, decode)
        first = where(await send(d, "a0", prompt(0, 0)))[0]
        await d.feed.poll(d.replicas())
        holders = {where(await send(d, f"a{i}", prompt(0, i)))[0] for i in range(1, 6)}
        await d.feed.poll(d.replicas())
        return d, first, holders

    d, first, holders = asyncio.run(scenario())
    assert holders == {first}
    by_name = {p.name: p for p in prefill}
    assert all(by_name[first].cached_tokens[f"a{i}"] == 160 for i in range(1, 6))  # the whole system prompt
    # first contact with each of the 6 replicas is a snapshot, then batches in order
    assert d.feed.counters.snapshots == 6 and d.feed.counters.batches == 6 and d.feed.counters.gaps == 0
    assert d.routing.indexes["prefill"].num_blocks(first) == 10  # the system prompt's blocks, from the snapshot


def test_groups_spread_over_replicas_and_each_stays_with_its_prefix():
    prefill, decode = pools()

    async def scenario():
        d = make(prefill, decode)
        chosen: dict[int, set[str]] = {}
        for i in range(4):
            for g in range(3):
                chosen.setdefault(g, set()).add(where(await send(d, f"g{g}-{i}", prompt(g, i)))[0])
                await d.feed.poll(d.replicas())
        return chosen

    chosen = asyncio.run(scenario())
    assert all(len(names) == 1 for names in chosen.values()), chosen  # every group kept one replica
    assert len(set.union(*chosen.values())) == 3  # and the three groups did not pile onto one


def test_expected_blocks_route_a_burst_before_any_event_arrives():
    prefill, decode = pools(step_s=0.02)

    async def scenario():
        d = make(prefill, decode)
        progress = await asyncio.gather(*(send(d, f"b{i}", prompt(1, i)) for i in range(4)))
        return {where(p)[0] for p in progress}

    assert len(asyncio.run(scenario())) == 1  # no poll at all: the expectation alone kept the burst together


def test_routing_recovers_after_the_holder_leaves_the_pool():
    prefill, decode = pools()

    async def scenario():
        d = make(prefill, decode)
        holder = where(await send(d, "r0", prompt(2, 0)))[0]
        await d.feed.poll(d.replicas())
        assert d.remove(holder)
        after = []
        for i in range(1, 5):
            after.append(where(await send(d, f"r{i}", prompt(2, i)))[0])
            await d.feed.poll(d.replicas())
        return d, holder, after

    d, holder, after = asyncio.run(scenario())
    assert holder not in after
    assert len(set(after)) == 1  # the first request after the loss warmed a new holder; the rest followed it
    index = d.routing.indexes["prefill"]
    assert index.num_blocks(holder) == 0 and holder not in index.overlap(index_hashes(prompt(2, 9)))


def index_hashes(tokens) -> list[int]:
    from tandem.engine.kv.prefix_cache import block_hashes

    return block_hashes(tokens, 16)


def hit_rate(lose_events: float, expect_ttl_s: float, pull_min_blocks: int = 0) -> tuple[float, int]:
    """Prefix hit rate of 4 rounds of 4 concurrent requests on 3 replicas (one per group, in a shuffled order),
    and how many requests completed. lose_events: of the prefill replicas' events. Prefix pulls off unless
    pull_min_blocks is set (the decode replicas' events would tell the router where each prefix is)."""
    prefill, decode = pools(lose_events=lose_events, step_s=0.01)

    async def scenario():
        d = make(prefill, decode, expect_ttl_s=expect_ttl_s, pull_min_blocks=pull_min_blocks)
        await d.feed.poll(d.replicas())  # first contact (a snapshot of empty caches): from now on, only events
        done = 0
        for i in range(4):
            groups = [0, 1, 2, 3]
            random.Random(i).shuffle(groups)
            rounds = await asyncio.gather(*(send(d, f"h{g}-{i}", prompt(g, i), max_tokens=3) for g in groups))
            done += sum(sum(len(o.token_ids) for p in progress for o in p.outputs) == 3 for progress in rounds)
            await d.feed.poll(d.replicas())
        return done

    done = asyncio.run(scenario())
    cached = sum(sum(p.cached_tokens.values()) for p in prefill)
    return cached / (16 * len(prompt(0, 0))), done


def test_lost_events_cost_hit_rate_and_nothing_else():
    full, done_full = hit_rate(0.0, 0.0)
    lossy, done_lossy = hit_rate(1.0, 0.0)  # every event lost and no expectations: routing is blind
    assert done_full == done_lossy == 16  # every request completed either way
    assert full > 0.7  # 12 of 16 requests find their group's 160 tokens (the first of each group cannot)
    assert lossy < full - 0.2
    # The decode replicas still publish: they cache every prompt they decoded, and pulls fetch it from them.
    pulled, done_pulled = hit_rate(1.0, 0.0, pull_min_blocks=4)
    assert done_pulled == 16 and pulled > lossy + 0.2


def test_a_gap_in_the_event_stream_triggers_a_snapshot_resync():
    prefill, decode = pools()

    async def scenario():
        d = make(prefill, decode)
        await send(d, "s0", prompt(0, 0))
        await d.feed.poll(d.replicas())
        target = next(p for p in prefill if p.prefilled)
        await send(d, "s1", prompt(1, 0))  # make sure events are waiting
        for p in prefill:
            p.cache.skip_next = True  # the next answer goes missing: a gap
        await d.feed.poll(d.replicas())
        await d.feed.poll(d.replicas())  # asks for and applies snapshots
        return d, target

    d, target = asyncio.run(scenario())
    assert d.feed.counters.gaps >= 1 and d.feed.counters.snapshots >= 1
    for p in prefill:  # after the resync the index holds exactly what each replica holds
        assert d.routing.indexes["prefill"].num_blocks(p.name) == len(p.cache.blocks)
    d.routing.indexes["prefill"].check_integrity()


def test_a_restarted_replica_is_resynchronized_from_its_new_log():
    prefill, decode = pools(n_prefill=3)

    async def scenario():
        d = make(prefill, decode)
        await send(d, "x0", prompt(3, 0))
        await d.feed.poll(d.replicas())
        holder = next(p for p in prefill if p.prefilled)
        holder.cache.blocks.clear()  # the replica restarts: an empty cache and a new event log (new epoch)
        holder.cache.log = KVEventLog()
        await d.feed.poll(d.replicas())
        return d, holder

    d, holder = asyncio.run(scenario())
    assert d.routing.indexes["prefill"].num_blocks(holder.name) == 0
    assert d.feed.counters.snapshots >= 4  # 3 first contacts (no epoch yet) + the restart


def test_short_uncached_prompts_prefill_on_the_decode_replica():
    prefill, decode = pools(n_prefill=3, n_decode=3)

    async def scenario():
        d = make(prefill, decode, local_prefill_max_tokens=64)
        short = where(await send(d, "short", tuple(range(30))))
        long = where(await send(d, "long", prompt(0, 0)))
        await d.feed.poll(d.replicas())
        # the long prompt's blocks now sit on its decode replica: a follow-up turn there is short
        follow = where(await send(d, "follow", prompt(0, 0) + (7, 8, 9)))
        return d, short, long, follow

    d, short, long, follow = asyncio.run(scenario())
    assert short[0] == "" and short[2] == "short_prompt"
    assert long[0].startswith("prefill-") and long[2] == "prefill_pool"
    assert follow[2] == "short_prompt" and follow[1] == long[1]
    assert d.routing.decisions[("decode_replica", "short_prompt")] == 2
    assert d.routing.decisions[("prefill_pool", "prefill_pool")] == 1


def test_a_saturated_prefill_pool_sends_prompts_to_the_decode_replicas():
    prefill, decode = pools(n_prefill=3, per_token_s=0.001)  # 163 tokens: ~0.16 s per prefill

    async def scenario():
        d = make(prefill, decode, prefill_saturation_tokens=100)
        busy = [asyncio.create_task(send(d, f"busy{i}", prompt(i, 0))) for i in range(3)]
        await asyncio.sleep(0.02)  # all three prefill replicas now hold 163 queued tokens each
        spill = where(await send(d, "spill", prompt(3, 1)))
        await asyncio.gather(*busy)
        after = where(await send(d, "after", prompt(3, 2)))
        return spill, after

    spill, after = asyncio.run(scenario())
    assert spill[0] == "" and spill[2] == "prefill_saturated"
    assert after[2] == "prefill_pool"


def test_session_affinity_keeps_a_conversation_on_its_replicas_until_they_are_overloaded():
    prefill, decode = pools(n_prefill=3, n_decode=3)

    async def scenario():
        d = make(prefill, decode, session_affinity=True, affinity_max_gap=1, policy="round_robin")
        turns = [where(await send(d, f"t{i}", prompt(i % 4, i), session="s1")) for i in range(4)]
        sticky = next(r for r in d.decode if r.name == turns[0][1])
        sticky.load.in_flight += 5  # now overloaded: more than 1 beyond the least busy
        moved = where(await send(d, "t-over", prompt(0, 9), session="s1"))
        sticky.load.in_flight -= 5
        return turns, moved

    turns, moved = asyncio.run(scenario())
    assert len({t[1] for t in turns}) == 1 and len({t[0] for t in turns}) == 1  # round_robin would rotate
    assert moved[1] != turns[0][1]


def test_tenants_with_the_same_prompt_never_share_cached_blocks():
    prefill, decode = pools(n_prefill=1, n_decode=1)

    async def scenario():
        d = make(prefill, decode)
        await send(d, "a1", prompt(0, 0), tenant="acme")
        await send(d, "a2", prompt(0, 0), tenant="acme")
        await send(d, "b1", prompt(0, 0), tenant="beta")
        return d

    asyncio.run(scenario())
    cached = prefill[0].cached_tokens
    assert cached["a2"] == 160 and cached["b1"] == 0
    assert set(decode[0].salts) == {"tenant:acme", "tenant:beta"}


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin", "random"])
def test_the_baseline_policies_route_every_request(policy):
    prefill, decode = pools()

    async def scenario():
        d = make(prefill, decode, policy=policy)
        return [where(await send(d, f"p{i}", prompt(i % 3, i))) for i in range(6)]

    routes = asyncio.run(scenario())
    assert all(r[2] == "prefill_pool" for r in routes)
    if policy == "round_robin":
        assert len({r[0] for r in routes}) == 3


def test_quiet_replicas_are_polled_less_often_busy_ones_more_and_a_finished_request_at_once():
    prefill, decode = pools(n_prefill=2, n_decode=1)
    calls = {p.name: 0 for p in prefill + decode}
    for replica in prefill + decode:
        def counted(epoch, since, replica=replica, real=replica.kv_events):
            calls[replica.name] += 1
            return real(epoch, since)
        replica.kv_events = counted
    now = [0.0]
    counts = []

    async def rounds(d, n):
        for _ in range(n):  # 62.5 ms apart: exact in binary
            await d.feed.poll(d.replicas(), 0.0625)
            now[0] += 0.0625
        counts.append(dict(calls))

    async def scenario():
        d = make(prefill, decode)
        d.feed.clock = lambda: now[0]
        await rounds(d, 40)  # 40 rounds with nothing happening
        d.prefill[0].load.in_flight = 1  # a request in flight there, its answers bringing nothing new
        await rounds(d, 20)
        d.prefill[0].load.in_flight = 0
        d.feed.nudge("prefill-0")  # ...and it ended
        await rounds(d, 1)

    asyncio.run(scenario())
    quiet, busy, nudged = counts
    assert all(count <= 8 for count in quiet.values()), quiet  # backed off to every 16 rounds, not 40 polls
    assert 5 <= busy["prefill-0"] - quiet["prefill-0"] <= 7  # every 4 rounds at most, not every 16
    assert busy["prefill-1"] - quiet["prefill-1"] <= 2
    assert nudged["prefill-0"] - busy["prefill-0"] == 1 and nudged["prefill-1"] == busy["prefill-1"]


# --- KV tiers: a prefix on a replica's host or disk tier, weighed by what copying it up costs ------------------------


def tiered_routing(holdings: dict[str, tuple[list[int], list[int], list[int]]],
                   costs: dict[str, TierHitCosts]) -> tuple[Routing, list[ReplicaLoad]]:
    """A router whose prefill index learnt each replica's (device, host, disk) hashes from a KV feed answer
    (a snapshot, with the replica's measured hit costs)."""
    routing = Routing(RoutingSettings(), block_size=16)
    feed = KVFeed(routing.indexes)
    loads = [ReplicaLoad(name) for name in holdings]
    for load in loads:
        device, host, disk = holdings[load.name]
        snapshot = KVSnapshot("epoch", 0, tuple(device), tuple(host), tuple(disk))
        feed.apply("prefill", load, KVEventsReply(snapshot, 100, costs.get(load.name)))
    return routing, loads


def test_a_prefix_on_a_host_tier_beats_recomputing_it_and_a_slow_disk_does_not():
    tokens = prompt(1, 0)
    hashes = list(block_hashes(tokens, 16))  # 10 full blocks
    decode = [ReplicaLoad("decode-0")]

    def chosen(holdings, costs) -> str:
        routing, loads = tiered_routing(holdings, costs)
        return routing.plan(tokens, prefill=loads, decode=decode).prefill.name

    fast_disk, slow_disk = TierHitCosts(0.05, 0.2, True), TierHitCosts(0.05, 1.5, True)
    assert chosen({"empty": ([], [], []), "host": ([], hashes, [])}, {"host": fast_disk}) == "host"
    # 6 blocks on one device against 10 on another replica's disk: 10 * (1 - 0.2) = 8 blocks' work saved beats 6
    split = {"device": (hashes[:6], [], []), "disk": ([], [], hashes)}
    assert chosen(split, {"disk": fast_disk}) == "disk"
    assert chosen(split, {"disk": TierHitCosts(0.05, 0.9, True)}) == "device"  # saves 1 block's work
    # a disk read that costs more than the prefill it saves (a fast accelerator): an empty replica goes first
    assert chosen({"disk": ([], [], hashes), "empty": ([], [], [])}, {"disk": slow_disk}) == "empty"
    # the first blocks on the device, the rest on the host: nearly all of it counts
    mixed = {"mixed": (hashes[:3], hashes[3:], []), "device": (hashes[:8], [], [])}
    assert chosen(mixed, {"mixed": fast_disk}) == "mixed"
    routing, loads = tiered_routing(mixed, {"mixed": fast_disk})
    assert loads[0].tier_hit_costs == fast_disk
    assert routing.indexes["prefill"].lower_tier_blocks("mixed", hashes) == (7, 0)
    assert routing.plan(tokens, prefill=loads, decode=decode).uncached_tokens == len(tokens) - 160


# --- prefix pulls: the chosen prefill replica takes a prefix another replica holds instead of computing it ---------


def busy_holder_scenario(pull_min_blocks: int = 4, evict_before_pull: bool = False):
    """prompt(0, 0) is computed on one prefill replica (and decoded on a decode replica, which caches it too);
    that replica is then busy, so prompt(0, 1), sharing its 10-block prefix, is routed to another one."""
    prefill, decode = pools()

    async def scenario():
        d = make(prefill, decode, pull_min_blocks=pull_min_blocks)
        first = where(await send(d, "a0", prompt(0, 0)))[0]
        await d.feed.poll(d.replicas())
        d.pools[first].load.in_flight = 50
        if evict_before_pull:  # every holder evicted the prefix since the router last heard
            for replica in prefill + decode:
                replica.cache.blocks.clear()
        progress = await send(d, "a1", prompt(0, 1))
        d.pools[first].load.in_flight = 0
        return d, first, progress

    return prefill, decode, asyncio.run(scenario())


def test_a_prefill_replica_pulls_the_prefix_a_busy_replica_holds_instead_of_computing_it():
    prefill, decode, (d, first, progress) = busy_holder_scenario()
    chosen = where(progress)[0]
    assert chosen != first
    assert d.pulls.outcomes == {"pulled": 1} and d.pulls.blocks_pulled == 10
    senders = [r.name for r in prefill + decode if r.pulls_out]
    assert len(senders) == 1 and senders[0] in (first, where(progress)[1])  # the busy replica, or the decode one
    puller = next(p for p in prefill if p.name == chosen)
    assert puller.cached_tokens[puller.prefilled[-1]] == 160  # the prefix was not computed again
    assert not puller.pulls_in  # kept


def test_without_pulls_the_prefix_is_computed_again():
    prefill, _, (d, first, progress) = busy_holder_scenario(pull_min_blocks=0)
    puller = next(p for p in prefill if p.name == where(progress)[0])
    assert not d.pulls.outcomes and puller.cached_tokens[puller.prefilled[-1]] == 0


def test_a_pull_whose_holder_evicted_the_prefix_is_abandoned_and_the_prompt_computed():
    prefill, decode, (d, first, progress) = busy_holder_scenario(evict_before_pull=True)
    puller = next(p for p in prefill if p.name == where(progress)[0])
    assert d.pulls.outcomes == {"failed": 1}
    assert not puller.pulls_in and puller.aborted  # its reservation was aborted
    assert puller.cached_tokens[puller.prefilled[-1]] == 0
    assert sum(len(o.token_ids) for p in progress for o in p.outputs) == 2  # served in full all the same


def test_a_prefix_only_on_a_holders_tier_is_pulled_when_bringing_it_up_still_pays():
    hashes = list(block_hashes(prompt(2, 0), 16))  # 10 blocks
    prefill, decode = pools(n_prefill=2, n_decode=1)
    replicas = ReplicaPools([Replica(p.name, "prefill", p) for p in prefill],
                            [Replica(d.name, "decode", d) for d in decode])
    routing = Routing(RoutingSettings(), block_size=16)
    routing.indexes["decode"].apply_snapshot("decode-0", (), hashes[:4], hashes[4:])  # on its host and disk tiers
    pulls = PrefixPulls(16, 4, routing.indexes, replicas)
    puller, holder = replicas.get("prefill-0"), replicas.get("decode-0")
    holder.load.tier_hit_costs = TierHitCosts(0.05, 0.2, True)
    plan = pulls.plan(hashes, puller, own=0.0)
    assert plan.holder is holder and plan.blocks == 10 and plan.bring_up
    assert plan.saved == pytest.approx(10 - 10 * 0.2 - (4 * 0.05 + 6 * 0.2 + 1))  # sent, and brought up first
    holder.load.tier_hit_costs = TierHitCosts(0.05, 1.5, True)  # a disk slower than computing: not worth it
    assert pulls.plan(hashes, puller, own=0.0) is None
