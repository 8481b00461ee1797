"""Sequences whose prompt KV arrives by transfer: reserve() parks them in WAITING_FOR_KV with blocks for the whole
prompt, they are never scheduled or preempted there, and admit_transferred() starts them with their first token
so that they continue exactly as a locally prefilled run would (scheduler harness, fake runner)."""

from __future__ import annotations

import pytest

from tandem.engine.request import RequestStatus, Sequence
from tandem.engine.sampling_params import SamplingParams
from tests.engine.fake_runner import FakeSample, next_token
from tests.engine.scheduler_harness import Harness

PROMPT = list(range(10, 33))  # 23 tokens: 6 blocks of 4


def transferred(h: Harness, request_id: str, prompt, max_tokens: int, seed: int = 5) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    seq = Sequence(f"{request_id}#0", request_id, 0, tuple(prompt), params, seed, 0, 0, None, h.block_size)
    blocks = h.scheduler.reserve(seq)
    assert blocks is not None and len(blocks) == -(-len(prompt) // h.block_size)
    return seq


def write_kv(h: Harness, seq: Sequence) -> None:
    """What the transfer does: every prompt position's KV lands in the reserved blocks."""
    for pos, token in enumerate(seq.prompt_token_ids):
        h.runner.slots[h.kv.block_table(seq.seq_id)[pos // h.block_size]][pos % h.block_size] = token


def test_a_transferred_request_continues_like_a_local_one():
    local = Harness(num_blocks=32)
    local.add("r", PROMPT, max_tokens=6, seed=5)
    local.run()
    h = Harness(num_blocks=32)
    seq = transferred(h, "r", PROMPT, max_tokens=6)
    for _ in range(3):  # parked: never scheduled while its KV is on the way
        assert h.step().is_empty and seq.status is RequestStatus.WAITING_FOR_KV
    write_kv(h, seq)
    update = h.scheduler.admit_transferred("r", FakeSample(next_token(PROMPT, 5)))
    assert update.status is None and seq.status is RequestStatus.RUNNING
    assert seq.num_computed_tokens == len(PROMPT)
    h.tokens[seq.seq_id].append(update.sampled.token_id)
    h.run()
    assert h.tokens["r#0"] == local.tokens["r#0"]
    assert h.runner.tokens_computed == 5  # decodes only: the prompt was never computed here
    assert h.kv.pool.num_in_use == 0 and h.kv.pool.num_parked > 0  # its full prompt blocks entered the cache


def test_no_room_reserves_nothing_and_aborts_free_the_reservation():
    h = Harness(num_blocks=8)
    first = transferred(h, "a", PROMPT, max_tokens=4)
    params = SamplingParams(max_tokens=4, temperature=0)
    second = Sequence("b#0", "b", 0, tuple(PROMPT), params, 1, 0, 1, None, h.block_size)
    assert h.scheduler.reserve(second) is None
    assert h.kv.pool.num_in_use == 6 and "b" not in h.scheduler._by_request
    h.scheduler.check_integrity()
    h.scheduler.abort_request("a")
    assert first.status is RequestStatus.FINISHED_ABORTED and h.kv.pool.num_in_use == 0
    h.scheduler.check_integrity()
    assert h.scheduler.reserve(second) is not None  # the room is back


def test_reservations_are_never_preempted_by_running_sequences():
    h = Harness(num_blocks=10)
    seq = transferred(h, "t", PROMPT, max_tokens=4)  # 6 of 10 blocks
    h.add("local", list(range(40, 49)), max_tokens=12)  # needs up to 6 blocks: must wait, not evict
    for _ in range(30):
        h.step()
        assert seq.status is RequestStatus.WAITING_FOR_KV and len(h.kv.block_table("t#0")) == 6
    h.scheduler.abort_request("t")
    h.run()
    assert h.finished["local#0"] == "length"


def test_a_first_token_can_end_the_request_at_admission():
    h = Harness(num_blocks=16, eos=frozenset({7}))
    transferred(h, "eos", PROMPT, max_tokens=8)
    assert h.scheduler.admit_transferred("eos", FakeSample(7)).status is RequestStatus.FINISHED_STOPPED
    transferred(h, "one", PROMPT, max_tokens=1)
    assert h.scheduler.admit_transferred("one", FakeSample(9)).status is RequestStatus.FINISHED_LENGTH
    assert h.kv.pool.num_in_use == 0
    h.scheduler.check_integrity()


def test_bad_reservations_and_admissions_are_refused():
    h = Harness(num_blocks=16)
    params = SamplingParams(max_tokens=4, n=2, temperature=0)
    forked = Sequence("n#0", "n", 0, tuple(PROMPT), params, 1, 0, 0, None, h.block_size, fork_seeds=(2,))
    with pytest.raises(ValueError, match="n=1"):
        h.scheduler.reserve(forked)
    with pytest.raises(KeyError, match="no KV reservation"):
        h.scheduler.admit_transferred("nobody", FakeSample(3))
    h.add("local", PROMPT, max_tokens=2)
    with pytest.raises(KeyError):
        h.scheduler.admit_transferred("local", FakeSample(3))  # queued normally, not reserved
    assert h.kv.pool.num_in_use == 0


def test_held_blocks_outlive_their_request_until_released():
    """hold_after (LLMEngine.hold_blocks_after): a finished request's blocks stay allocated (and counted, and
    consistent) under the hold's key, an aborted one's too; releasing one key frees only its blocks."""
    h = Harness(num_blocks=32)
    h.scheduler.hold_after.update({"a": "a/0", "b": "b/0"})
    h.add("a", PROMPT, max_tokens=2)
    h.add("b", PROMPT[:9], max_tokens=50)
    while "a#0" in h.scheduler.seqs:
        h.step()
    assert "b#0" in h.scheduler.seqs and h.kv.num_holds == 1
    with_b = h.kv.pool.num_in_use
    h.scheduler.abort_request("b")
    assert not h.scheduler.has_unfinished() and h.kv.num_holds == 2
    assert h.kv.pool.num_in_use == with_b  # nothing freed: both requests' blocks are held
    h.scheduler.check_integrity()
    assert h.kv.release("a/0") == 1
    only_b = h.kv.pool.num_in_use
    assert 0 < only_b < with_b and h.kv.num_holds == 1
    assert h.kv.release("a/0") == 0  # already released
    assert h.kv.release("b/0") == 1 and h.kv.pool.num_in_use == 0 and h.kv.num_holds == 0
    h.scheduler.check_integrity()
