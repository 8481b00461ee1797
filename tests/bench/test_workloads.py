"""`tandem bench`'s workloads: length distributions, the long-prompt mix, shared prefixes, sessions and traces, in
tokens of the served model's tokenizer, the same for the same seed."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from tandem.bench.loadgen.workloads import PromptMaker, WorkloadConfig, build, parse_length, read_trace
from tandem.engine.loader.model_info import load_model_info


@pytest.fixture(scope="module")
def maker():
    info = load_model_info(None)
    return PromptMaker(info.tokenizer, info.config.vocab_size)


def test_length_distributions_parse_and_sample_as_written():
    rng = random.Random(0)
    assert parse_length("fixed:256").sample(rng) == 256 and parse_length("64").sample(rng) == 64
    uniform = [parse_length("uniform:10,20").sample(rng) for _ in range(2000)]
    assert min(uniform) == 10 and max(uniform) == 20
    lognormal = [parse_length("lognormal:300,0.5").sample(rng) for _ in range(4000)]
    assert statistics.median(lognormal) == pytest.approx(300, rel=0.05)
    for bad in ("zipf:3", "uniform:20,10", "lognormal:300", "fixed:0", "fixed:x"):
        with pytest.raises(ValueError, match="bad length distribution"):
            parse_length(bad)


def test_the_long_mix_has_the_asked_share_of_long_prompts_and_is_reproducible(maker):
    config = WorkloadConfig(kind="long-mix", input=parse_length("uniform:20,40"), output=parse_length("fixed:8"),
                            long_share=0.25, long_input=parse_length("fixed:3000"), seed=7)
    conversations = build(config, maker, [0.0] * 400)
    classes = [c.requests[0].klass for c in conversations]
    assert classes.count("long") / 400 == pytest.approx(0.25, abs=0.06)
    assert {len(c.requests[0].prompt_ids) for c in conversations if c.requests[0].klass == "long"} == {3000}
    assert all(20 <= len(c.requests[0].prompt_ids) <= 40 for c in conversations if c.requests[0].klass == "short")
    assert build(config, maker, [0.0] * 400) == conversations
    assert build(WorkloadConfig(**{**vars(config), "seed": 8}), maker, [0.0] * 400) != conversations


def test_shared_prefix_groups_share_their_prefix_exactly(maker):
    config = WorkloadConfig(kind="shared-prefix", input=parse_length("fixed:10"), prefix_groups=3, prefix_len=64)
    conversations = build(config, maker, [0.0] * 60)
    by_group: dict[str, set] = {}
    for c in conversations:
        r = c.requests[0]
        assert len(r.prompt_ids) == 74
        by_group.setdefault(r.klass, set()).add(r.prompt_ids[:64])
    assert len(by_group) == 3 and all(len(prefixes) == 1 for prefixes in by_group.values())


def test_sessions_are_turns_of_user_text_of_about_the_asked_length(maker):
    config = WorkloadConfig(kind="sessions", input=parse_length("fixed:30"), turns=4, think_time_s=2.0)
    conversations = build(config, maker, [0.0, 1.0])
    assert [len(c.requests) for c in conversations] == [4, 4] and conversations[0].think_s == 2.0
    turn = conversations[0].requests[1]
    assert turn.session_id == conversations[0].requests[0].session_id != conversations[1].requests[0].session_id
    assert turn.messages[0][0] == "user" and len(maker.tokenizer.encode(turn.messages[0][1])) == pytest.approx(30, abs=3)


def test_a_trace_is_read_with_shared_blocks_and_bad_rows_are_named(maker, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 5000, "input_length": 40, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 3000, "input_length": 20, "output_length": 2, "hash_ids": [1, 5], "session_id": "a"}]))
    conversations = read_trace(path, maker, time_unit="ms", speedup=2.0, block_tokens=16)
    assert [c.at_s for c in conversations] == [0.0, 1.0]  # sorted, from the first timestamp, twice as fast
    first, second = conversations[0].requests[0], conversations[1].requests[0]
    assert (len(first.prompt_ids), len(second.prompt_ids)) == (20, 40)
    assert first.prompt_ids[:16] == second.prompt_ids[:16] and first.session_id == "a"
    path.write_text(json.dumps({"timestamp": 1, "output_length": 3}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:1: a trace row needs timestamp, input_length or prompt"):
        read_trace(path, maker)
