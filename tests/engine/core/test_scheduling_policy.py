"""The scheduler's policies (engine/core/scheduling_policy.py) on the scheduler harness: fcfs ignores priorities,
sjf runs short prompts first and lets nothing wait past its aging bound, fair shares the steps between tenants
by weight and keeps a heavy tenant's backlog from delaying a light one, and priority preemption takes running
sequences of lower priority, the least work first, once a higher one has waited preempt_after_s, with every
output unchanged."""

from __future__ import annotations

import pytest

from tandem.engine.engine_config import SchedulingConfig
from tandem.engine.request import RequestStatus, Sequence
from tandem.engine.sampling_params import SamplingParams

from tests.engine.fake_runner import expected_output
from tests.engine.scheduler_harness import Harness


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + i % 80 for i in range(n)]


def starts(h: Harness) -> list[str]:
    """Request ids in the order they were first scheduled (the steps before included), running the harness to
    the end."""
    h.run()
    order: list[str] = []
    for out in h.outputs:
        order += [rid for seq_id in out.num_scheduled_tokens if (rid := seq_id.partition("#")[0]) not in order]
    return order


def policy(name: str, **kwargs) -> SchedulingConfig:
    return SchedulingConfig(policy=name, **kwargs)


def test_fcfs_serves_in_arrival_order_whatever_the_priority():
    h = Harness(max_num_seqs=1, scheduling=policy("fcfs"))
    for rid, priority in (("a", 5), ("b", 1), ("c", -3)):
        h.add(rid, prompt(4), 1, priority=priority)
    assert starts(h) == ["a", "b", "c"]


def test_sjf_runs_the_shortest_prompt_first_and_an_aged_one_before_all():
    h = Harness(max_num_seqs=1, scheduling=policy("sjf", sjf_aging_s=10.0))
    h.add("long", prompt(40), 2)
    h.add("mid", prompt(12), 2)
    h.add("short", prompt(4), 2)
    h.add("short-more-tokens", prompt(4), 3)
    assert starts(h) == ["short", "short-more-tokens", "mid", "long"]
    h = Harness(max_num_seqs=1, scheduling=policy("sjf", sjf_aging_s=10.0))
    h.add("long", prompt(40), 2)
    h.add("short", prompt(4), 2)
    h.step()  # "short" runs; "long" waits
    h.clock.now = 10.0  # "long" has waited its aging bound
    for i in range(3):
        h.add(f"later-short-{i}", prompt(4, 30 + i), 2)
    assert starts(h)[:2] == ["short", "long"]  # "long" before the shorter ones that arrived later


def test_sjf_starts_a_short_prompt_before_the_next_chunk_of_a_running_long_one_until_that_one_has_aged():
    for name, short_first in (("fcfs", False), ("sjf", True)):
        h = Harness(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=32,
                    scheduling=policy(name, sjf_aging_s=10.0))
        h.add("long", prompt(200, 1), 2, seed=1)
        h.step()  # the long prompt's first chunk: it runs, prefilling
        h.add("short", prompt(12, 2), 2, seed=2)
        out = h.step()
        if short_first:  # the short prompt whole, the long one's chunk the rest of the step
            assert out.num_scheduled_tokens == {"short#0": 12, "long#0": 20}, out.num_scheduled_tokens
        else:
            assert out.num_scheduled_tokens == {"long#0": 32}, out.num_scheduled_tokens
        h.run()
        assert h.tokens["long#0"] == expected_output(prompt(200, 1), 1, 2)
        assert h.tokens["short#0"] == expected_output(prompt(12, 2), 2, 2)
        assert h.kv.pool.num_in_use == 0
    h = Harness(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=32, scheduling=policy("sjf", sjf_aging_s=10.0))
    h.add("long", prompt(200, 1), 2, seed=1)
    h.step()
    h.clock.now = 10.0  # the long prompt entered the queue its aging bound ago: it keeps its room
    h.add("short", prompt(12, 2), 2, seed=2)
    assert h.step().num_scheduled_tokens == {"long#0": 32}


def test_fair_keeps_a_heavy_tenants_backlog_from_delaying_a_light_one():
    for name, light_starts in (("fcfs", 6), ("fair", 1)):  # after every heavy request / after the running one
        h = Harness(max_num_seqs=1, scheduling=policy(name))
        for i in range(6):
            h.add(f"heavy-{i}", prompt(40, i), 4, tenant="batch")
        h.step()  # the first heavy one runs
        h.add("light", prompt(8, 90), 4, tenant="chat")
        assert starts(h).index("light") == light_starts, name


def test_fair_shares_the_tokens_by_weight_while_both_tenants_wait():
    scheduling = policy("fair", tenant_weights=(("gold", 2.0), ("bronze", 1.0)))
    h = Harness(num_blocks=512, max_num_seqs=1, scheduling=scheduling)
    for i in range(12):
        h.add(f"gold-{i}", prompt(20, i), 1, tenant="gold")
        h.add(f"bronze-{i}", prompt(20, 40 + i), 1, tenant="bronze")
    first = starts(h)[:12]  # while both still have requests waiting
    gold = sum(rid.startswith("gold") for rid in first)
    assert gold == 8, first  # 2:1


def test_under_fair_the_lighter_tenants_prompt_is_computed_alone_and_nothing_changes_output():
    h = Harness(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=32, scheduling=policy("fair"))
    h.add("long", prompt(200, 1), 2, tenant="batch", seed=1)  # chunked over several steps
    h.step()
    h.add("short", prompt(20, 2), 2, tenant="chat", seed=2)
    out = h.step()  # chat has 20 prompt tokens to compute, batch 168: the step computes chat's alone
    assert out.num_scheduled_tokens == {"short#0": 20}, out.num_scheduled_tokens
    h.add("longer", prompt(40, 3), 2, tenant="chat", seed=3)
    out = h.step()  # alone again, as much as the room one decode leaves: 31 of its 40
    assert out.num_scheduled_tokens == {"short#0": 1, "longer#0": 31}, out.num_scheduled_tokens
    h.add("longest", prompt(200, 4), 2, tenant="chat", seed=4)
    out = h.step()  # chat now has more to compute than batch: the step is shared
    assert {"long#0", "longer#0"} <= set(out.num_scheduled_tokens), out.num_scheduled_tokens
    h.run()
    for rid, p, seed in (("long", prompt(200, 1), 1), ("short", prompt(20, 2), 2), ("longer", prompt(40, 3), 3),
                         ("longest", prompt(200, 4), 4)):
        assert h.tokens[f"{rid}#0"] == expected_output(p, seed, 2), rid
    assert h.kv.pool.num_in_use == 0


def test_a_stream_of_short_requests_takes_at_most_half_the_steps_from_another_tenants_prompt():
    h = Harness(num_blocks=512, max_num_seqs=64, max_num_batched_tokens=16, scheduling=policy("fair"))
    h.add("long", prompt(250, 1), 1, tenant="batch", seed=1)
    for i in range(24):  # a new short request of another tenant before every step
        h.add(f"short-{i}", prompt(8, 2 + i), 1, tenant="chat", seed=2 + i)
        h.step()
    with_long = ["long#0" in out.num_scheduled_tokens for out in h.outputs]
    for end in range(8, len(with_long) + 1):
        assert sum(with_long[end - 8:end]) >= 4, with_long  # the long prompt advances in 4 of any 8 steps
    assert sum(with_long) < len(with_long)  # and short prompts were computed alone in the others


def test_fair_reserve_keeps_a_decoding_tenants_share_of_the_step_until_it_has_been_away_that_long():
    def batch_chunk(reserve_s: float) -> tuple[Harness, list[int]]:
        h = Harness(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=32,
                    scheduling=policy("fair", fair_reserve_s=reserve_s))
        h.add("chat", prompt(8, 1), 6, tenant="chat", seed=1)
        h.step()  # chat's prompt: now it only decodes
        h.add("batch", prompt(200, 2), 2, tenant="batch", seed=2)
        return h, [h.step().num_scheduled_tokens.get("batch#0", 0) for _ in range(3)]

    _, chunks = batch_chunk(0.0)
    assert chunks == [31, 31, 31]  # the room the one decode leaves, all of it to batch
    h, chunks = batch_chunk(5.0)
    assert chunks == [15, 15, 15]  # chat's half of that room is kept for it, unused
    h.run()  # both finish (no time passes on the harness's clock)
    h.add("batch-2", prompt(200, 3), 2, tenant="batch", seed=3)
    assert h.step().num_scheduled_tokens["batch-2#0"] == 16  # chat, gone, is within its reserve: half of 32
    h.clock.now = 5.1  # chat away longer than fair_reserve_s: the whole step is batch's again
    assert h.step().num_scheduled_tokens["batch-2#0"] == 32
    h.run()
    for rid, p, seed in (("chat", prompt(8, 1), 1), ("batch", prompt(200, 2), 2), ("batch-2", prompt(200, 3), 3)):
        assert h.tokens[f"{rid}#0"] == expected_output(p, seed, 6 if rid == "chat" else 2), rid
    assert h.kv.pool.num_in_use == 0


def test_fair_reserve_is_for_fair_only():
    with pytest.raises(ValueError, match="fair_reserve_s keeps tenants' shares of the step under policy fair"):
        policy("priority", fair_reserve_s=5.0)
    with pytest.raises(ValueError, match="fair_reserve_s must be >= 0"):
        policy("fair", fair_reserve_s=-1.0)


def test_a_higher_priority_preempts_after_waiting_and_the_victims_output_is_unchanged():
    h = Harness(num_blocks=64, max_num_seqs=2, scheduling=policy("priority", preempt_after_s=1.0))
    h.add("low-long", prompt(12, 1), 30, priority=5, seed=1)
    h.add("low-short", prompt(4, 2), 30, priority=5, seed=2)
    for _ in range(3):
        h.step()
    h.add("high", prompt(6, 3), 4, priority=0, seed=3)
    h.step()  # the sequence cap is full: "high" waits, nobody is preempted yet
    assert h.scheduler.num_preemptions == 0 and "high#0" not in h.outputs[-1].num_scheduled_tokens
    h.clock.now = 1.0
    out = h.step()
    assert "high#0" in out.num_scheduled_tokens and h.scheduler.num_preemptions == 1
    [victim] = [s for s in h.scheduler.waiting if s.status is RequestStatus.PREEMPTED]
    assert victim.request_id == "low-short"  # fewer computed tokens lost than "low-long"
    h.run()
    for rid, p, seed, n in (("low-long", prompt(12, 1), 1, 30), ("low-short", prompt(4, 2), 2, 30),
                            ("high", prompt(6, 3), 3, 4)):
        assert h.tokens[f"{rid}#0"] == expected_output(p, seed, n), rid
    assert h.kv.pool.num_in_use == 0


def test_priority_preemption_never_takes_an_equal_or_higher_priority_and_frees_blocks_for_the_urgent_one():
    # 10 blocks of 4 tokens: two running sequences hold them all; the urgent one needs blocks, not a seat
    h = Harness(num_blocks=10, max_num_seqs=4, scheduling=policy("priority", preempt_after_s=0.0))
    h.add("peer", prompt(16, 1), 4, priority=0, seed=1)
    h.add("low", prompt(16, 2), 4, priority=3, seed=2)
    h.step()
    h.add("high", prompt(12, 3), 2, priority=0, seed=3)
    out = h.step()
    assert "high#0" in out.num_scheduled_tokens
    assert [s.request_id for s in h.scheduler.waiting] == ["low"]  # "peer" has the same priority: kept
    h.run()
    assert h.tokens["low#0"] == expected_output(prompt(16, 2), 2, 4)


def test_a_reservation_that_waited_preempt_after_s_elsewhere_preempts_a_lower_priority_for_room():
    # 10 blocks of 4 tokens: "low" and "peer" hold 9; a transferred prompt of 16 tokens needs 4
    h = Harness(num_blocks=10, max_num_seqs=4, scheduling=policy("priority", preempt_after_s=1.0))
    h.add("low", prompt(16, 1), 8, priority=5, seed=1)
    h.add("peer", prompt(12, 2), 8, priority=0, seed=2)  # the reservation's own priority: never its victim
    h.step(), h.step()
    params = SamplingParams(max_tokens=2, temperature=0)
    high = Sequence("high#0", "high", 0, tuple(prompt(16, 3)), params, 3, 0, 9, None, h.block_size)
    assert h.scheduler.reserve(high, waited_s=0.5) is None  # not waited long enough: nothing changes
    assert h.scheduler.num_preemptions == 0 and "high" not in h.scheduler._by_request
    assert h.scheduler.reserve(high, waited_s=1.0) is not None
    assert h.scheduler.num_preemptions == 1 and high.status is RequestStatus.WAITING_FOR_KV
    assert [s.request_id for s in h.scheduler.waiting] == ["low"]
    h.scheduler.check_integrity()
    h.scheduler.abort_request("high")
    h.run()
    assert h.tokens["low#0"] == expected_output(prompt(16, 1), 1, 8)  # recomputed: the same output
    assert h.tokens["peer#0"] == expected_output(prompt(12, 2), 2, 8)
    assert h.kv.pool.num_in_use == 0


def test_preempting_by_priority_under_fcfs_is_refused():
    with pytest.raises(ValueError, match="fcfs ignores"):
        policy("fcfs", preempt_after_s=1.0)
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulingConfig(policy="lottery")


def test_under_fair_an_urgent_request_starts_even_when_its_tenants_share_of_the_step_is_spent():
    scheduling = policy("fair", preempt_after_s=0.0)
    h = Harness(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=32, scheduling=scheduling)
    h.add("a-low", prompt(200, 1), 2, priority=5, tenant="a", seed=1)  # a long prefill of tenant a
    h.add("b-low", prompt(200, 2), 2, priority=5, tenant="b", seed=2)  # tenant b has prompt tokens too
    h.step()
    h.add("a-high", prompt(8, 3), 2, priority=0, tenant="a", seed=3)
    out = h.step()  # a's running prefill spent a's share of the step; the urgent one goes anyway
    assert "a-high#0" in out.num_scheduled_tokens
    h.run()
    for rid, seed in (("a-low", 1), ("b-low", 2)):
        assert h.tokens[f"{rid}#0"] == expected_output(prompt(200, seed), seed, 2)
