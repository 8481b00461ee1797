from __future__ import annotations

import pytest

from tandem.engine.core.scheduler import SchedulerConfig
from tandem.engine.errors import RequestRejectedError
from tandem.engine.kv.kv_events import BlockRemoved, BlockStored
from tandem.engine.request import RequestStatus

from tests.engine.fake_runner import expected_output
from tests.engine.scheduler_harness import Harness


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + i % 80 for i in range(n)]


def test_decodes_first_then_a_prefill_chunk_fills_the_budget():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", prompt(3), 10)
    h.add("b", prompt(5, 20), 10)
    h.step()  # both prompts (8 tokens)
    h.add("long", prompt(30, 40), 4)
    out = h.step()
    assert dict(out.num_scheduled_tokens) == {"a#0": 1, "b#0": 1, "long#0": 6}
    out = h.step()
    assert dict(out.num_scheduled_tokens) == {"a#0": 1, "b#0": 1, "long#0": 6}
    h.run()
    assert h.tokens["long#0"] == expected_output(prompt(30, 40), 0, 4)


def test_chunked_and_unchunked_prefill_give_the_same_tokens():
    results = []
    for budget, chunked in ((7, True), (256, False)):
        h = Harness(max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        for i in range(5):
            h.add(f"r{i}", prompt(20 + 9 * i, i), 6, seed=i)
        h.run()
        results.append(dict(h.tokens))
        assert max(o.total_num_scheduled_tokens for o in h.outputs) <= budget
    assert results[0] == results[1]
    assert results[0]["r3#0"] == expected_output(prompt(47, 3), 3, 6)


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    h = Harness(max_num_batched_tokens=40, enable_chunked_prefill=False, max_model_len=40)
    h.add("a", prompt(30), 2)
    h.add("b", prompt(38, 1), 2)
    assert dict(h.step().num_scheduled_tokens) == {"a#0": 30}  # b is not split to fill the last 10 tokens
    assert dict(h.step().num_scheduled_tokens) == {"a#0": 1, "b#0": 38}
    h.run()
    with pytest.raises(ValueError, match="must be at least max_model_len"):
        SchedulerConfig(max_model_len=100, max_num_batched_tokens=50, enable_chunked_prefill=False)


def test_max_num_seqs_caps_the_running_batch():
    h = Harness(max_num_seqs=3)
    for i in range(6):
        h.add(f"r{i}", prompt(4, i), 3)
    assert len(h.step().num_scheduled_tokens) == 3
    h.run()
    assert all(len(o.num_scheduled_tokens) <= 3 for o in h.outputs)
    assert len(h.finished) == 6


def test_waiting_requests_start_by_priority_then_arrival():
    h = Harness(max_num_seqs=1)
    h.add("late-low", prompt(4), 1, priority=5)
    h.add("first-mid", prompt(4), 1, priority=1)
    h.add("second-mid", prompt(4), 1, priority=1)
    h.add("urgent", prompt(4), 1, priority=-3)
    order = [next(iter(h.step().num_scheduled_tokens)) for _ in range(4)]
    assert order == ["urgent#0", "first-mid#0", "second-mid#0", "late-low#0"]


def test_preemption_takes_the_lowest_priority_latest_and_output_is_unchanged():
    # 12 blocks of 4 tokens; three requests that each grow to 24 tokens (6 blocks) cannot all run at once.
    h = Harness(num_blocks=12, enable_chunked_prefill=True)
    h.add("a", prompt(8, 1), 16, priority=0, seed=1)
    h.add("b", prompt(8, 2), 16, priority=1, seed=2)
    h.add("c", prompt(8, 3), 16, priority=0, seed=3)
    first_victim = None
    while h.scheduler.has_unfinished():
        before = h.scheduler.num_preemptions
        h.step()
        if first_victim is None and h.scheduler.num_preemptions > before:
            first_victim = next(s for s in h.scheduler.waiting if s.status is RequestStatus.PREEMPTED).request_id
    assert h.scheduler.num_preemptions >= 1
    assert first_victim == "b"  # priority 1 loses to both priority-0 requests
    for rid, seed in (("a", 1), ("b", 2), ("c", 3)):
        assert h.tokens[f"{rid}#0"] == expected_output(prompt(8, seed), seed, 16)
    assert h.kv.pool.num_in_use == 0


def test_requests_that_can_never_fit_are_rejected_and_others_go_on():
    h = Harness(num_blocks=8, max_model_len=64)
    h.add("ok", prompt(5), 4)
    with pytest.raises(RequestRejectedError, match="exceeds the maximum context length 64"):
        h.add("too-long", prompt(60), 10)
    with pytest.raises(RequestRejectedError, match="needs 10 KV blocks but the whole KV cache has 8"):
        h.add("too-big", prompt(30), 10)
    with pytest.raises(ValueError, match="already in use"):
        h.add("ok", prompt(5), 4)
    h.run()
    assert h.finished == {"ok#0": "length"}


def test_a_shared_prefix_is_computed_once_and_events_say_so():
    h = Harness(block_size=4)
    shared = prompt(20)
    h.add("first", shared + [1, 2, 3], 2)
    h.run()
    computed = h.runner.tokens_computed
    h.add("second", shared + [7, 8], 2)
    h.run()
    # 20 shared tokens = 5 full blocks are reused; 2 prompt tokens + 1 decode are computed.
    assert h.runner.tokens_computed - computed == 3
    second = h.outputs[-2].new_seqs[0]
    assert second.num_computed_tokens == 20
    assert h.tokens["second#0"] == expected_output(shared + [7, 8], 0, 2)
    stored = [e for e in h.events.events if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored[:5]] == [tuple(shared[i:i + 4]) for i in range(0, 20, 4)]
    assert h.scheduler.stats().num_prompt_tokens_cached == 20


def test_a_fully_cached_prompt_still_computes_its_last_block():
    h = Harness(block_size=4)
    h.add("first", prompt(16), 1)
    h.run()
    h.add("again", prompt(16), 1)
    out = h.step()
    assert out.new_seqs[0].num_computed_tokens == 12 and out.num_scheduled_tokens["again#0"] == 4


def test_salted_tenants_never_share_blocks():
    h = Harness(block_size=4)
    h.add("a", prompt(16), 1, salt="tenant-a")
    h.run()
    h.add("b", prompt(16), 1, salt="tenant-b")
    h.add("a2", prompt(16), 1, salt="tenant-a")
    out = h.step()
    computed = {d.seq_id: d.num_computed_tokens for d in out.new_seqs}
    assert computed == {"b#0": 0, "a2#0": 12}


def test_unreferenced_cached_blocks_are_evicted_lru_when_space_is_needed():
    h = Harness(num_blocks=8, block_size=4)
    h.add("old", prompt(16, 1), 1)
    h.run()
    h.add("newer", prompt(16, 2), 1)
    h.run()  # 8 blocks: the pool is now all parked prefixes
    h.events.drain()
    h.add("big", prompt(20, 3), 1)
    h.run()
    removed = [hsh for e in h.events.events if isinstance(e, BlockRemoved) for hsh in e.block_hashes]
    assert len(removed) == 5 and h.kv.pool.num_in_use == 0
    h.add("newer-again", prompt(16, 2), 1)
    assert h.step().new_seqs[0].num_computed_tokens > 0  # "newer" outlived "old"


@pytest.mark.parametrize("prompt_len", [10, 12])  # partial and block-aligned last prompt block
def test_n_samples_share_the_prompt_and_copy_the_partial_block_before_writing(prompt_len):
    h = Harness(num_blocks=32, block_size=4)
    h.add("r", prompt(prompt_len), 5, n=3, seed=40)
    out = h.step()
    assert [f.child_id for f in out.forks] == ["r#1", "r#2"]
    shared_blocks = set(h.kv.block_table("r#0"))
    assert all(set(h.kv.block_table(f"r#{i}")) == shared_blocks for i in (1, 2))
    out = h.step()
    assert len(out.block_copies) == (2 if prompt_len % 4 else 0)  # the last writer keeps the original
    h.run()
    for i in range(3):
        assert h.tokens[f"r#{i}"] == expected_output(prompt(prompt_len), 40 + i, 5)
    assert h.kv.pool.num_in_use == 0


@pytest.mark.parametrize("phase", ["waiting", "mid-prefill", "decoding"])
def test_abort_in_any_phase_frees_every_block(phase):
    h = Harness(max_num_batched_tokens=8)
    h.add("other", prompt(6), 30)
    h.add("victim", prompt(40), 30, n=2)
    if phase != "waiting":
        h.step()
        h.step()
    if phase == "decoding":
        while h.scheduler.seqs["victim#0"].is_prefilling:
            h.step()
        h.step()
    aborted = h.scheduler.abort_request("victim")
    assert aborted and all(s.status is RequestStatus.FINISHED_ABORTED for s in aborted)
    assert h.kv.block_table("victim#0") == [] and not any(s.request_id == "victim" for s in h.scheduler.seqs.values())
    h.scheduler.check_integrity()
    h.run()
    assert h.kv.pool.num_in_use == 0 and h.finished["other#0"] == "length"


def test_stop_tokens_and_eos_finish_a_sequence():
    tokens = expected_output(prompt(5), 0, 10)
    h = Harness(eos=frozenset({tokens[3]}))
    h.add("eos", prompt(5), 10)
    h.add("stop-id", prompt(5), 10, stop_token_ids=[tokens[1]])
    h.add("ignore", prompt(5), 10, ignore_eos=True)
    h.run()
    assert h.tokens["eos#0"] == tokens[:4] and h.finished["eos#0"] == "stop"
    assert h.tokens["stop-id#0"] == tokens[:2]
    assert h.tokens["ignore#0"] == tokens and h.finished["ignore#0"] == "length"
