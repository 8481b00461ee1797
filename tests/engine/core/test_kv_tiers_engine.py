"""KV tiers on the embedded model: multi-turn sessions whose prefixes the pool evicts come back from host memory or
disk with greedy output identical to tiers off; a damaged, missing or unwritable file is recomputed and counted,
never served; tenants never share a tier's block; nothing is left behind (blocks, tier slots, folders)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig, KVTiersConfig
from tandem.engine.kv import tier_store
from tandem.engine.kv.disk_blocks import DiskTierError
from tandem.engine.kv.kv_events import DEVICE, DISK, HOST, TIERS, KVEventRecorder
from tandem.engine.parallel.layout import ParallelConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.router.kv_index import PrefixIndex

from tests.engine.engine_helpers import run_all

SESSIONS = 5
POOL_BLOCKS = 14  # two sessions' prompts: every earlier session's prefix is evicted before its next turn
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def first_turns(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(f"Session {i}: " + f"The history of city number {i} is long and full of events. " * 6)
            for i in range(SESSIONS)]


def converse(engine: LLMEngine, turns: list[list[int]], salts=None, between=None) -> dict[str, list[int]]:
    """Two turns of every session, one request at a time: each second turn is the first turn, its answer and a
    follow-up question. between(engine) runs after the first turns."""
    answers = {}
    for i, prompt in enumerate(turns):
        engine.add_request(f"a{i}", prompt, GREEDY, cache_salt=salts and salts[0])
        answers[f"a{i}"] = run_all(engine)[(f"a{i}", 0)].token_ids
    if between is not None:
        between(engine)
    follow_up = engine.tokenizer.encode(" And what happened next?")
    for i, prompt in enumerate(turns):
        engine.add_request(f"b{i}", prompt + answers[f"a{i}"] + follow_up, GREEDY, cache_salt=salts and salts[1])
        answers[f"b{i}"] = run_all(engine)[(f"b{i}", 0)].token_ids
    return answers


def tiered(loaded, tiers: KVTiersConfig | None, **kwargs) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=POOL_BLOCKS, max_model_len=1024, max_num_seqs=2,
                                          check_integrity=True, kv_tiers=tiers), **kwargs)


def host_only() -> KVTiersConfig:
    return KVTiersConfig(host_bytes=1 << 30)


def through_disk(folder: Path) -> KVTiersConfig:
    """A host tier of 4 blocks of the embedded model (737 KB each): most blocks live on disk."""
    return KVTiersConfig(host_bytes=3_000_000, disk_path=str(folder), disk_bytes=1 << 30)


@pytest.fixture(scope="module")
def reference(embedded):
    turns = first_turns(embedded.tokenizer)
    with tiered(embedded, None) as engine:
        answers = converse(engine, turns)
        stats = engine.stats()
    assert stats.tiers is None and stats.num_prompt_tokens_from_tiers == 0
    return turns, answers, stats


def assert_clean(engine: LLMEngine) -> None:
    """No block owned, no copy pending, every tier consistent (check_integrity covers the tiers)."""
    engine.check_integrity()
    assert engine.kv_manager.pool.num_in_use == 0 and not engine.scheduler.loading


def test_host_tier_serves_evicted_prefixes_with_identical_output(embedded, reference):
    turns, expected, plain = reference
    with tiered(embedded, host_only()) as engine:
        assert converse(engine, turns) == expected
        stats = engine.stats()
        assert_clean(engine)
    assert stats.tiers.host_hits >= 4 * (SESSIONS - 1) and stats.num_prompt_tokens_from_tiers >= 64 * (SESSIONS - 1)
    assert stats.prefix_hit_rate > plain.prefix_hit_rate
    assert stats.num_tokens_computed < plain.num_tokens_computed - stats.num_prompt_tokens_from_tiers // 2


def test_disk_tier_serves_them_too_and_its_folder_goes_with_the_engine(embedded, reference, tmp_path):
    turns, expected, _ = reference
    events = KVEventRecorder()
    with tiered(embedded, through_disk(tmp_path), event_sink=events) as engine:
        assert converse(engine, turns) == expected
        stats = engine.stats()
        folder = Path(engine.tier_plan.disk_folder)
        assert len(list(folder.glob("rank0/*.kv"))) == stats.tiers.disk_blocks > 0
        assert_clean(engine)
        held = {tier: engine.cached_block_hashes(tier) for tier in TIERS}
    assert stats.tiers.disk_hits >= 3 * (SESSIONS - 2) and stats.tiers.spilled > 0 and not stats.tiers.failures
    assert not folder.exists()
    # The router's index fed the engine's events believes what a snapshot of the engine says, tier by tier.
    fed, snapshot = PrefixIndex(), PrefixIndex()
    fed.apply("r", events.drain())
    snapshot.apply_snapshot("r", held[DEVICE], held[HOST], held[DISK])
    assert held[HOST] and held[DISK]
    for h in {h for hashes in held.values() for h in hashes}:
        assert fed.overlap([h]) == snapshot.overlap([h]) == {"r": 1}
        assert fed.lower_tier_blocks("r", [h]) == snapshot.lower_tier_blocks("r", [h])
    assert fed.num_blocks("r") == len(held[DEVICE]) and fed.num_lower_blocks("r") == len({*held[HOST], *held[DISK]})
    # What a hit on each tier costs, measured: a host copy beats recomputing the block; the disk was read.
    costs = stats.tier_hit_costs
    assert costs.measured and stats.tiers.loaded_blocks > 0 and stats.tiers.read_blocks > 0
    assert 0 < costs.host < 1 and costs.disk > costs.host and stats.prefill_tokens_per_s > 0


def damage(kind: str):
    def hurt(engine: LLMEngine) -> None:
        files = sorted(engine.tier_plan.rank_folder(0).glob("*.kv"))
        assert files
        for path in files:
            data = path.read_bytes()
            if kind == "corrupt":
                path.write_bytes(data[:-7] + bytes(b ^ 0xFF for b in data[-7:]))
            elif kind == "truncated":
                path.write_bytes(data[:len(data) // 2])
            else:
                path.unlink()
    return hurt


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "missing"])
def test_a_damaged_file_is_recomputed_and_counted_never_served(embedded, reference, tmp_path, kind):
    turns, expected, _ = reference
    with tiered(embedded, through_disk(tmp_path)) as engine:
        assert converse(engine, turns, between=damage(kind)) == expected
        stats = engine.stats()
        assert_clean(engine)
    assert stats.tiers.failures.get(kind, 0) >= 1
    assert stats.tiers.disk_blocks + sum(stats.tiers.failures.values()) <= stats.tiers.spilled


def test_a_full_disk_degrades_to_recomputation_with_a_logged_reason(embedded, reference, tmp_path, monkeypatch,
                                                                      caplog):
    turns, expected, _ = reference

    def no_space(folder, block_hash, payload):
        raise DiskTierError(errno.ENOSPC, f"cannot write KV block {block_hash:#x} to {folder}: No space left on device")

    monkeypatch.setattr(tier_store, "write_block", no_space)
    with tiered(embedded, through_disk(tmp_path)) as engine:
        assert converse(engine, turns) == expected
        stats = engine.stats()
        assert_clean(engine)
    assert stats.tiers.failures.get("write failed", 0) >= 1 and stats.tiers.disk_hits == 0
    assert "No space left on device" in caplog.text


def test_sessions_at_once_under_pressure_all_finish_and_match(embedded, reference, tmp_path):
    """Every second turn arrives together: sequences loading, loaded and computing share a pool too small for all
    of them (preemptions included), and nobody waits forever on blocks a loaded sequence holds."""
    turns, expected, _ = reference
    follow_up = embedded.tokenizer.encode(" And what happened next?")
    with LLMEngine(embedded, EngineConfig(num_kv_blocks=POOL_BLOCKS + 4, max_model_len=1024, max_num_seqs=4,
                                          max_num_batched_tokens=64, check_integrity=True,
                                          kv_tiers=through_disk(tmp_path))) as engine:
        for i, prompt in enumerate(turns):
            engine.add_request(f"a{i}", prompt, GREEDY)
            run_all(engine)
        for i, prompt in enumerate(turns):
            engine.add_request(f"b{i}", prompt + expected[f"a{i}"] + follow_up, GREEDY)
        done = run_all(engine, max_steps=3000)
        assert {f"b{i}": done[(f"b{i}", 0)].token_ids for i in range(SESSIONS)} == {
            k: v for k, v in expected.items() if k.startswith("b")}
        assert engine.stats().num_prompt_tokens_from_tiers > 0
        assert_clean(engine)


def test_tiers_are_tenant_scoped(embedded, reference):
    turns, expected, _ = reference
    with tiered(embedded, host_only()) as engine:
        assert converse(engine, turns, salts=("tenant-a", "tenant-b")) == expected
        stats = engine.stats()
    assert stats.tiers.host_hits == 0 and stats.num_prompt_tokens_cached == 0
    with tiered(embedded, host_only()) as engine:
        converse(engine, turns, salts=("tenant-a", "tenant-a"))
        assert engine.stats().tiers.host_hits > 0


def test_an_aborted_request_leaves_no_tier_block_behind(embedded, reference):
    turns, _, _ = reference
    with tiered(embedded, host_only()) as engine:
        for i, prompt in enumerate(turns):
            engine.add_request(f"a{i}", prompt, GREEDY)
            run_all(engine)
        engine.add_request("again", turns[0] + turns[1], GREEDY)
        engine.step()  # its prefix is copied up from the host tier in this step
        assert engine.stats().tiers.host_hits > 0
        engine.abort_request("again")
        assert_clean(engine)
        engine.add_request("after", turns[0], GREEDY)
        run_all(engine)
        assert_clean(engine)


def test_split_replica_moves_each_ranks_share_and_matches(embedded, reference, tmp_path):
    turns, expected, _ = reference
    with tiered(embedded, through_disk(tmp_path), parallel=ParallelConfig(tp=2)) as engine:
        assert converse(engine, turns) == expected
        stats = engine.stats()
        ranks = sorted(p.name for p in Path(engine.tier_plan.disk_folder).iterdir())
        assert_clean(engine)
    assert ranks == ["rank0", "rank1"] and stats.tiers.disk_hits > 0
    assert not list(tmp_path.glob("tandem-kv-*"))  # the replica's folder, every rank's in it, went with it
