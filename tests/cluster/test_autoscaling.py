"""The autoscaling policy (cluster/autoscaling.py) on synthetic samples, and whole autoscaled clusters of batching
mock replicas (cluster/mock_cluster.py) on a virtual-time loop: minutes of load in seconds, the same on every
machine."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.cluster.autoscaling import PoolPolicy, PoolSample, ScalingSettings
from tandem.cluster.mock_cluster import MockCluster
from tandem.cluster.pool_pressure import SLO, PoolGauge
from tandem.router.mocks.batching import StepCosts
from tandem.router.pool_signals import PoolLoad
from tandem.cluster.virtual_time import run_virtual

SETTINGS = ScalingSettings(interval_s=1.0, up_window_s=5.0, down_window_s=30.0)


def run_policy(policy: PoolPolicy, seconds: int, pressure, needed, *, start_delay: int = 0, ready: int = 1):
    """Drives the policy one sample per second with a pool that carries out its decisions (new replicas serve
    start_delay seconds later, drained ones leave at once). pressure/needed: functions of (t, ready). Returns
    the decisions that changed something and the ready count per second."""
    starting: list[int] = []  # times the starting replicas become ready
    decisions, counts = [], []
    for t in range(seconds):
        ready += sum(1 for s in starting if s <= t)
        starting = [s for s in starting if s > t]
        d = policy.decide(PoolSample(float(t), ready, len(starting), 0, pressure(t, ready), needed(t, ready)))
        if d.action == "up":
            starting += [t + start_delay] * (d.desired - d.current)
        elif d.action == "down":
            ready = d.desired - len(starting)
        if d.action != "hold":
            decisions.append(d)
        counts.append(ready)
    return decisions, counts


def test_a_sustained_overload_scales_up_once_to_what_is_needed_within_the_window():
    policy = PoolPolicy("prefill", 2, 16, SETTINGS)
    work = lambda t: 1.0 if t < 20 else 3.0  # replicas' worth of work at target: a step at t = 20 (pressure 1.5)
    decisions, counts = run_policy(policy, 60, lambda t, r: work(t) / r, lambda t, r: work(t), start_delay=8,
                                   ready=2)
    assert [(d.action, d.current, d.desired) for d in decisions] == [("up", 2, 3)]
    assert 20 + SETTINGS.up_window_s <= decisions[0].t <= 20 + SETTINGS.up_window_s + 1
    assert counts[-1] == 3


def test_a_burst_far_over_capacity_scales_up_within_the_panic_window():
    policy = PoolPolicy("prefill", 1, 16, SETTINGS)
    work = lambda t: 1.0 if t < 20 else 6.0  # pressure 6 from t = 20
    decisions, counts = run_policy(policy, 60, lambda t, r: work(t) / r, lambda t, r: work(t), start_delay=8)
    assert [(d.action, d.current, d.desired) for d in decisions] == [("up", 1, 6)]
    assert 20 + SETTINGS.panic_window_s <= decisions[0].t <= 20 + SETTINGS.panic_window_s + 1
    assert decisions[0].t < 20 + SETTINGS.up_window_s
    assert "for 3 s" in decisions[0].reason and counts[-1] == 6
    with pytest.raises(ValueError, match="panic_window_s"):
        ScalingSettings(panic_window_s=20.0)
    with pytest.raises(ValueError, match="panic_pressure"):
        ScalingSettings(panic_pressure=1.0)


def test_a_blip_shorter_than_the_window_does_nothing():
    policy = PoolPolicy("decode", 1, 8, SETTINGS)
    work = lambda t: 3.0 if 10 <= t < 13 else 0.5
    decisions, _ = run_policy(policy, 40, lambda t, r: work(t) / r, lambda t, r: work(t))
    assert decisions == []


def test_starting_replicas_are_capacity_that_is_coming():
    """A start slower than the window does not make the pool ask again while the load holds still (Dynamo
    #12430's over-scaling after cold starts); a load that doubles meanwhile still does."""
    policy = PoolPolicy("prefill", 1, 32, SETTINGS)
    decisions, counts = run_policy(policy, 120, lambda t, r: 4.0 / r, lambda t, r: 4.0, start_delay=60)
    assert [(d.current, d.desired) for d in decisions] == [(1, 4)]
    assert counts[-1] == 4
    policy = PoolPolicy("prefill", 1, 32, SETTINGS)
    work = lambda t: 4.0 if t < 30 else 12.0
    decisions, _ = run_policy(policy, 120, lambda t, r: work(t) / r, lambda t, r: work(t), start_delay=60)
    assert [(d.current, d.desired) for d in decisions] == [(1, 4), (4, 12)]


def test_scale_down_waits_for_the_longer_window_and_keeps_the_margin():
    policy = PoolPolicy("decode", 1, 16, SETTINGS)
    work = lambda t: 6.0 if t < 20 else 2.4
    decisions, counts = run_policy(policy, 100, lambda t, r: work(t) / r, lambda t, r: work(t), ready=6)
    assert [(d.action, d.current, d.desired) for d in decisions] == [("down", 6, 3)]
    assert decisions[0].t >= 20 + SETTINGS.down_window_s
    assert counts[-1] == 3  # ceil(2.4): at the busiest tick of the window the rest stay at target


def test_a_square_wave_does_not_flap():
    """High for 40 s, low for 40 s, five times: at most one decision per phase, and the count follows the load."""
    policy = PoolPolicy("decode", 1, 16, SETTINGS)
    work = lambda t: 8.0 if (t // 40) % 2 == 0 else 2.0
    decisions, counts = run_policy(policy, 400, lambda t, r: work(t) / r, lambda t, r: work(t), start_delay=5)
    phases = [sum(1 for d in decisions if p * 40 <= d.t < (p + 1) * 40) for p in range(10)]
    assert max(phases) <= 1, phases
    assert len(decisions) <= 10
    assert counts[39 + 80] == 8  # a high phase's end


def test_noise_around_the_target_does_not_flap():
    rng = random.Random(0)
    policy = PoolPolicy("decode", 1, 16, SETTINGS)
    noise = [rng.uniform(0.6, 1.15) for _ in range(600)]
    decisions, _ = run_policy(policy, 600, lambda t, r: noise[t] * 3 / r, lambda t, r: noise[t] * 3, ready=3)
    assert len(decisions) <= 2


def test_bounds_and_pins():
    policy = PoolPolicy("decode", 2, 4, SETTINGS)
    decisions, counts = run_policy(policy, 40, lambda t, r: 10.0, lambda t, r: 50.0, ready=1)
    assert [(d.current, d.desired) for d in decisions] == [(1, 2), (2, 4)]  # min first, then max, never past
    assert decisions[0].reason == "below min (2)"
    policy.pin(7)
    d = policy.decide(PoolSample(100.0, 4, 0, 0, 0.0, 0.0))
    assert (d.action, d.desired, d.reason) == ("up", 7, "pinned by `tandem scale`")
    assert policy.decide(PoolSample(101.0, 7, 0, 0, 0.0, 0.0)).action == "hold"
    policy.pin(None)
    with pytest.raises(ValueError):
        policy.pin(-1)
    with pytest.raises(ValueError):
        ScalingSettings(up_window_s=60, down_window_s=30)


def test_gauge_learns_decode_capacity_from_itl():
    """ITL = 10 ms + 1 ms per sequence, SLO 50 ms at 80%: a replica holds 30 sequences."""
    gauge = PoolGauge("decode", SLO(itl_s=0.05), max_num_seqs=256)
    for n in (5, 10, 20, 40, 15):
        itl = 0.010 + 0.001 * n
        sample = gauge.sample(PoolLoad("decode", 2, 10.0, itl_recent_p50=itl, itl_p90=itl, in_flight=2 * n,
                                       token_weighted_decoding=n, decoding=2 * n, arrived_output_tokens=5 * 30 * 25,
                                       itl_points=((n, itl), (n, itl)),
                                       first_tokens=5), 0.0, ready=2)
    assert sample.inputs["seqs_per_replica"] == pytest.approx(30, rel=0.01)
    assert sample.needed == pytest.approx(750 * 0.04 / 30, rel=0.01)  # 750 tokens/s asked, 30 / 0.04 s each
    assert sample.pressure == pytest.approx(0.025 / 0.04)
    idle = gauge.sample(PoolLoad("decode", 2, 10.0), 1.0, ready=2)
    assert (idle.pressure, idle.needed) == (None, 0.0)


def test_gauge_sizes_prefill_from_its_measured_rate():
    """A busy replica computed 1000 uncached tokens a second; prompts arrive at 2000 tokens a second, half of
    them cached; 20,000 tokens wait."""
    gauge = PoolGauge("prefill", SLO(ttft_s=1.0), startup_s=10.0)
    load = PoolLoad("prefill", 1, 10.0, prefill_p90=2.0, prefill_tokens=10_000, prefill_busy_s=10.0,
                    prefill_prompt_tokens=20_000, arrived_tokens=10_000, rate_window_s=5.0,
                    queued_prefill_tokens=20_000, first_tokens=10)
    sample = gauge.sample(load, 0.0, ready=1)
    assert gauge.prefill_rate == 1000.0
    # Arrivals plus the backlog over 10 s (a start-up time), at 80%; the backlog grows by what arrives beyond the
    # one replica's rate while new ones start.
    assert sample.needed == pytest.approx((1000 + (20_000 + 0 * 10) / 10) / 800)
    assert sample.pressure == pytest.approx(20_000 / (1000 * 0.8))  # the queue would take 25x the budget


# -- whole clusters on virtual time -----------------------------------------------------------------------------

COSTS = StepCosts(step_s=0.01, decode_token_s=0.001, prefill_token_s=1e-4, max_num_batched_tokens=4096,
                  max_num_seqs=128)
CLUSTER_SETTINGS = ScalingSettings(interval_s=1.0, up_window_s=5.0, down_window_s=20.0)


async def drive(cluster: MockCluster, phases: list[tuple[float, float, int, int]], seed: int = 0):
    """phases: (seconds, requests per second, prompt tokens, output tokens), Poisson arrivals. Returns
    (results, failures, sent): (arrival, timings) of every answered request by phase index, the errors, and how
    many requests were sent."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    results: list[list] = [[] for _ in phases]
    failures: list[BaseException] = []
    tasks = []

    async def one(i: int, phase: int, prompt_len: int, max_tokens: int) -> None:
        prompt = tuple(rng.randrange(1, 30000) for _ in range(prompt_len))
        try:
            arrival = loop.time()
            results[phase].append((arrival, await cluster.generate(f"r{i}", prompt, max_tokens)))
        except Exception as e:  # counted: the test asserts there are none
            failures.append(e)

    i = 0
    for phase, (seconds, rate, prompt_len, max_tokens) in enumerate(phases):
        end = loop.time() + seconds
        while (t := loop.time() + rng.expovariate(rate)) < end:
            await asyncio.sleep(t - loop.time())
            tasks.append(loop.create_task(one(i, phase, prompt_len, max_tokens)))
            i += 1
        await asyncio.sleep(max(0.0, end - loop.time()))
    await asyncio.gather(*tasks)
    return results, failures, len(tasks)


def cluster_run(mode: str, phases, *, initial=None, bounds=None, start_delay_s=5.0, slo=SLO(ttft_s=1.0, itl_s=0.05)):
    async def main():
        cluster = MockCluster(mode, COSTS, initial=initial or {"prefill": 1, "decode": 1},
                              bounds=bounds or {"prefill": (1, 8), "decode": (1, 8)}, slo=slo,
                              settings=CLUSTER_SETTINGS, start_delay_s=start_delay_s)
        async with cluster.running():
            results, failures, sent = await drive(cluster, phases)
            assert sum(len(r) for r in results) + len(failures) == sent
            held = [await r.api.stats() for r in cluster.driver.replicas()]
        return cluster, results, failures, held

    return run_virtual(main())


def per_phase(cluster: MockCluster, pool: str, ends: list[float]) -> int:
    """The most decisions the pool made in one phase (phases end at these times)."""
    starts = [0.0, *ends[:-1]]
    return max(sum(1 for d in cluster.decisions(pool) if a <= d.t < b) for a, b in zip(starts, ends))


def decided(cluster: MockCluster, pool: str) -> list[tuple[str, int, int]]:
    return [(d.action, d.current, d.desired) for d in cluster.decisions(pool)]


def test_a_prefill_heavy_step_scales_prefill_alone_and_back_down():
    """20 req/s of 1000-token prompts and 4 output tokens need 2.5 prefill replicas at 80% (10k tokens/s each)
    and about one sequence in flight on decode. The one decision that scales up also sizes for the backlog that
    builds up until its replicas serve, so the requests that arrive two start-up times after the step meet the
    TTFT SLO; the extra replicas leave after a down window."""
    cluster, results, failures, held = cluster_run("disaggregated", [(20, 2, 1000, 4), (60, 20, 1000, 4),
                                                                     (60, 0.5, 1000, 4)])
    assert failures == []
    ups = [d for d in cluster.decisions("prefill") if d.action == "up"]
    assert len(ups) == 1 and ups[0].t <= 20 + CLUSTER_SETTINGS.up_window_s + 2
    assert 3 <= ups[0].desired <= 6
    absorbed = sorted(t.ttft_s for arrival, t in results[1] if arrival >= 20 + 2 * 5.0)
    assert absorbed[int(0.9 * len(absorbed))] <= 1.0
    assert decided(cluster, "decode") == []
    assert cluster.replica_count("prefill") == 1  # back down in the quiet phase
    assert per_phase(cluster, "prefill", [20, 80, 140]) <= 2
    assert all(s.kv_blocks_in_use == 0 for s in held)


def test_a_decode_heavy_step_scales_decode_alone_and_drains_under_load():
    """10 req/s of 200 output tokens: ITL 10 ms + 1 ms per sequence holds about 30 sequences per replica at
    80% of a 50 ms SLO; the load keeps 60-70 in flight. Then 2 req/s: replicas drain while they still decode
    (every sequence lasts seconds), and every request finishes."""
    cluster, results, failures, held = cluster_run("disaggregated", [(10, 1, 32, 200), (60, 10, 32, 200),
                                                                     (50, 2, 32, 200)])
    assert failures == []
    assert decided(cluster, "prefill") == []
    decisions = decided(cluster, "decode")
    assert per_phase(cluster, "decode", [10, 70, 120]) <= 2
    ups = [d for d in cluster.decisions("decode") if d.t < 70]
    assert ups and all(d.action == "up" for d in ups) and ups[-1].desired in (3, 4)
    assert decisions[-1][0] == "down" and cluster.replica_count("decode") == 1
    drained = [e for e in cluster.events if e.pool == "decode" and e.what == "draining"]
    assert drained and max(e.in_flight for e in drained) > 0
    assert all(s.kv_blocks_in_use == 0 for s in held)
    # Sequences admitted while one replica held them all keep its 0.1 s ITL until they finish (20 s): requests
    # that arrive once those have drained meet the SLO.
    late = sorted(t.mean_itl_s for arrival, t in results[1] if arrival >= 10 + 35)
    assert late and late[int(0.9 * len(late))] <= 0.05


def test_a_slow_start_does_not_over_scale_and_scale_down_under_load_loses_nothing():
    """Starts take 30 s (six up windows) while 12 req/s of 1000-token prompts need 2 prefill replicas (1.6 at
    80%) and one is serving: the backlog grows all the while, yet the pool asks once. Then the load drops but
    does not stop, so the added replica drains while requests are in flight on it."""
    cluster, results, failures, held = cluster_run(
        "disaggregated", [(50, 12, 1000, 4), (60, 4, 1000, 4)], start_delay_s=30.0)
    assert failures == []
    ups = [d for d in cluster.decisions("prefill") if d.action == "up"]
    assert len(ups) == 1 and ups[0].desired <= 3
    assert [d.action for d in cluster.decisions("prefill")][-1] == "down"
    assert cluster.replica_count("prefill") == 1
    assert all(s.kv_blocks_in_use == 0 for s in held)
    assert all(r.loop.running == {} and r.loop.waiting == {} for r in cluster.stopped)


def test_requests_refused_for_capacity_count_as_demand():
    """Admission control refuses what the cluster cannot start in time (router/admission.py); the pools must
    still grow for it: 10 admitted and 30 refused in the window read as four times the admitted tokens."""
    gauge = PoolGauge("prefill", SLO(ttft_s=1.0), startup_s=10.0)
    base = dict(prefill_p90=0.5, prefill_tokens=10_000, prefill_busy_s=10.0, prefill_prompt_tokens=10_000,
                arrived_tokens=10_000, arrived_requests=10, rate_window_s=5.0, first_tokens=10)
    admitted_only = gauge.sample(PoolLoad("prefill", 1, 10.0, **base), 0.0, ready=1)
    with_refused = PoolGauge("prefill", SLO(ttft_s=1.0), startup_s=10.0).sample(
        PoolLoad("prefill", 1, 10.0, refused_requests=30, **base), 0.0, ready=1)
    assert admitted_only.inputs["arriving_tokens_per_s"] == 2000
    assert with_refused.inputs["arriving_tokens_per_s"] == 8000
    assert with_refused.needed > 3 * admitted_only.needed
