"""KV tiers' policy (engine/core/kv_tiers.py): which copies a step makes, in which order, and what a failure undoes."""

from __future__ import annotations

import os

import pytest

from tandem.engine.core.kv_tiers import PRIOR_HIT_COSTS, KVTiers, hit_costs
from tandem.engine.kv.kv_events import DISK, HOST, BlockRemoved, BlockStored, KVEventRecorder
from tandem.engine.kv.tier_plan import FOLDER_PREFIX, plan_tiers, remove_orphan_folders
from tandem.engine.scheduler_output import DropBlock, FetchBlock, LoadBlocks, SaveBlocks, SpillBlock, TierReport


def test_saves_are_gathered_into_one_copy_and_a_host_hit_is_not_saved_again():
    tiers = KVTiers(host_slots=4)
    tiers.save([(0xA, 10), (0xB, 11)])
    ops = tiers.take_ops()
    assert ops.ops == (SaveBlocks((10, 11), (0, 1)),) and ops.sync == 0 and not ops.reports
    tiers.save([(0xA, 12)])  # the host has 0xA: nothing to copy
    assert tiers.take_ops().ops == ()
    assert tiers.stats().saved == 2 and tiers.stats().host_blocks == 2


def test_a_full_host_spills_its_oldest_block_to_disk_before_the_slot_is_rewritten():
    tiers = KVTiers(host_slots=2, disk_slots=8)
    tiers.save([(0xA, 1), (0xB, 2)])
    tiers.save([(0xC, 3)])  # displaces 0xA (least recently used), whose slot 0 this step's gathered save just filled
    ops = tiers.take_ops().ops
    assert ops == (SaveBlocks((1, 2), (0, 1)), SpillBlock(0, 0xA), SaveBlocks((3,), (0,)))
    assert 0xA in tiers.disk and 0xA not in tiers.host


def test_a_full_disk_drops_its_oldest_file():
    tiers = KVTiers(host_slots=1, disk_slots=1)
    tiers.save([(0xA, 1)])
    tiers.save([(0xB, 2)])
    tiers.save([(0xC, 3)])
    ops = tiers.take_ops().ops
    assert DropBlock(0xA) in ops and ops.index(DropBlock(0xA)) < ops.index(SpillBlock(0, 0xB))
    assert tiers.stats().dropped == 1 and 0xB in tiers.disk


def test_a_block_saved_and_reused_in_the_same_step_is_copied_before_the_step_writes():
    tiers = KVTiers(host_slots=4)
    tiers.save([(0xA, 7), (0xB, 8)])
    tiers.reused([8])
    ops = tiers.take_ops()
    assert ops.ops == (SaveBlocks((7, 8), (0, 1)),) and ops.sync == 1
    tiers.reused([8])  # a later step: last step's copies are done
    assert tiers.take_ops().sync == 0


def test_load_reads_host_slots_and_stages_disk_blocks_through_the_host():
    tiers = KVTiers(host_slots=2, disk_slots=4)
    tiers.save([(0xA, 1), (0xB, 2)])
    tiers.save([(0xC, 3)])  # 0xA goes to disk
    tiers.take_ops()
    assert tiers.match([0xA, 0xB, 0xC, 0xD]) == 3
    tiers.load([0xA, 0xB], [20, 21])
    ops = tiers.take_ops()
    fetch = next(op for op in ops.ops if isinstance(op, FetchBlock))
    assert fetch.block_hash == 0xA and ops.reports
    load = ops.ops[-1]
    assert isinstance(load, LoadBlocks) and load.blocks == (20, 21) and load.hashes == (0xA, 0xB)
    assert load.slots[0] == fetch.slot and load.slots[1] != fetch.slot  # 0xB was pinned: not displaced by 0xA
    stats = tiers.stats()
    assert (stats.host_hits, stats.disk_hits) == (1, 1)
    tiers.check_integrity()


def test_a_run_longer_than_the_host_tier_comes_up_in_pieces_through_its_slots():
    tiers = KVTiers(host_slots=2, disk_slots=8)
    for i in range(5):  # 0xA0..0xA4: all but the last two end on disk
        tiers.save([(0xA0 + i, i)])
    tiers.take_ops()
    run = [0xA0 + i for i in range(5)]
    assert tiers.match(run) == 5
    tiers.load(run, [10, 11, 12, 13, 14])
    loads = [op for op in tiers.take_ops().ops if isinstance(op, LoadBlocks)]
    assert [op.blocks for op in loads] == [(10, 11), (12, 13), (14,)]
    assert [op.hashes for op in loads] == [(0xA0, 0xA1), (0xA2, 0xA3), (0xA4,)]
    assert tiers.stats().disk_hits + tiers.stats().host_hits == 5
    tiers.check_integrity()


def test_a_failed_disk_copy_takes_the_block_out_of_both_tiers_and_is_counted():
    tiers = KVTiers(host_slots=1, disk_slots=4)
    tiers.save([(0xA, 1)])
    tiers.save([(0xB, 2)])
    tiers.take_ops()
    assert tiers.failed([(0xA, "corrupt"), (0xB, "write failed: No space left on device")]) == {0xA, 0xB}
    assert 0xA not in tiers.disk and 0xB not in tiers.host
    assert tiers.stats().failures == {"corrupt": 1, "write failed": 1}
    tiers.check_integrity()


def test_plan_sizes_the_tiers_and_makes_a_folder_per_replica(tmp_path):
    plan = plan_tiers(10_000, str(tmp_path), 100_000, 1000, num_ranks=2)
    assert plan.host_slots == 10 and plan.disk_slots == 100_000 // (1000 + 2 * 48)
    assert plan.rank_folder(1).parent.name.startswith(f"{FOLDER_PREFIX}{os.getpid()}-")
    assert plan_tiers(10_000, None, None, 1000, 1).disk_folder is None
    with pytest.raises(ValueError, match="holds no KV block"):
        plan_tiers(999, None, None, 1000, 1)
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be used"):
        plan_tiers(10_000, str(blocker / "sub"), 100_000, 1000, 1)


def test_folders_of_replicas_that_are_gone_are_removed(tmp_path):
    dead = tmp_path / f"{FOLDER_PREFIX}999999999-abcd"
    alive = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-abcd"
    for folder in (dead, alive):
        (folder / "rank0").mkdir(parents=True)
    assert remove_orphan_folders(tmp_path) == [dead]
    assert alive.exists() and not dead.exists()


def test_every_block_entering_or_leaving_a_tier_is_published_naming_the_tier():
    recorder = KVEventRecorder()
    tiers = KVTiers(host_slots=1, disk_slots=1, sink=recorder)
    tiers.save([(0xA, 1)])
    assert recorder.drain() == [BlockStored(0xA, None, (), None, HOST)]
    tiers.save([(0xB, 2)])  # 0xA spills to disk
    assert recorder.drain() == [BlockRemoved((0xA,), HOST), BlockStored(0xA, None, (), None, DISK),
                                BlockStored(0xB, None, (), None, HOST)]
    tiers.save([(0xC, 3)])  # 0xB spills, displacing 0xA from the disk
    assert recorder.drain() == [BlockRemoved((0xB,), HOST), BlockRemoved((0xA,), DISK),
                                BlockStored(0xB, None, (), None, DISK), BlockStored(0xC, None, (), None, HOST)]
    tiers.take_ops()
    tiers.load([0xB], [9])  # staged through the host; 0xC leaves it, and cannot displace 0xB (being read) on disk
    assert recorder.drain() == [BlockRemoved((0xC,), HOST), BlockStored(0xB, None, (), None, HOST)]
    assert DropBlock(0xB) not in tiers.take_ops().ops
    assert tiers.hashes(HOST) == (0xB,) and tiers.hashes(DISK) == (0xB,)
    tiers.failed([(0xB, "corrupt")])
    assert sorted(recorder.drain(), key=lambda e: e.tier) == [BlockRemoved((0xB,), DISK), BlockRemoved((0xB,), HOST)]
    assert tiers.hashes(HOST) == () and tiers.hashes(DISK) == ()
    tiers.check_integrity()


def test_hit_costs_compare_measured_copies_with_the_replica_prefill_speed():
    tiers = KVTiers(host_slots=4, disk_slots=4)
    assert hit_costs(tiers.stats(), None, 16) == PRIOR_HIT_COSTS  # nothing measured yet
    tiers.done(TierReport(times=(("host", 4, 0.004), ("disk", 1, 0.002), ("disk", 1, 0.006))))
    stats = tiers.stats()
    assert (stats.loaded_blocks, stats.read_blocks) == (4, 2) and stats.read_s == pytest.approx(0.008)
    costs = hit_costs(stats, 1600.0, 16)  # recomputing a block of 16 tokens takes 10 ms
    assert costs.measured
    assert costs.host == pytest.approx(0.1)  # 1 ms a block up from the host
    assert costs.disk == pytest.approx(0.5)  # 4 ms a read, then 1 ms up from the host
    slow = hit_costs(stats, 16000.0, 16)  # a replica that prefills 10x faster: the disk costs more than it saves
    assert slow.disk == pytest.approx(5.0)
    unread = KVTiers(host_slots=4, disk_slots=4)
    unread.done(TierReport(times=(("host", 2, 0.02),)))
    partial = hit_costs(unread.stats(), 1600.0, 16)  # the disk was never read: its prior, at least the host's
    assert not partial.measured and partial.host == pytest.approx(1.0) and partial.disk == pytest.approx(1.0)
