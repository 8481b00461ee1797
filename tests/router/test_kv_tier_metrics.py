"""A replica's KV tier counters as /metrics families and as its `tandem status` line."""

from __future__ import annotations

import dataclasses

from tandem.cluster.commands import kv_tiers_line
from tandem.engine.core.kv_tiers import TierHitCosts, TierStats
from tandem.router.metrics import _kv_tier_metrics

STATS = TierStats(host_blocks=30, host_capacity=64, disk_blocks=200, disk_capacity=5000, host_hits=12,
                  disk_hits=7, saved=90, spilled=40, dropped=3, failures={"corrupt": 2, "write failed": 1},
                  block_bytes=1000, loaded_blocks=19, load_s=0.5, read_blocks=7, read_s=1.25)
COSTS = TierHitCosts(host=0.02, disk=0.3, measured=True)


def samples(families) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def at(name: str, **labels: str) -> tuple[str, tuple]:
    return name, tuple(sorted((dict(pool="decode", replica="decode-0") | labels).items()))


def test_hits_use_copies_and_failures_are_labelled_by_tier_and_reason():
    got = samples(_kv_tier_metrics({("decode", "decode-0"): STATS}, {("decode", "decode-0"): COSTS}))
    assert got[at("tandem_kv_tier_hit_blocks_total", tier="host")] == 12
    assert got[at("tandem_kv_tier_hit_blocks_total", tier="disk")] == 7
    assert got[at("tandem_kv_tier_blocks", tier="disk")] == 200
    assert got[at("tandem_kv_tier_capacity_blocks", tier="host")] == 64
    assert got[at("tandem_kv_tier_copied_blocks_total", copy="spilled")] == 40
    assert got[at("tandem_kv_tier_failures_total", reason="corrupt")] == 2
    assert got[at("tandem_kv_tier_failures_total", reason="write failed")] == 1
    assert got[at("tandem_kv_tier_copied_up_bytes_total", tier="host")] == 19_000
    assert got[at("tandem_kv_tier_copied_up_seconds_total", tier="disk")] == 1.25
    assert got[at("tandem_kv_tier_hit_cost", tier="disk")] == 0.3


def test_a_replica_without_a_disk_tier_has_no_disk_series():
    host_only = dataclasses.replace(STATS, disk_blocks=0, disk_capacity=0, disk_hits=0, failures={})
    got = samples(_kv_tier_metrics({("decode", "decode-0"): host_only}))
    assert not [key for key in got if ("tier", "disk") in key[1]]


def test_status_line_names_each_tier_and_the_failures():
    line = kv_tiers_line(dataclasses.asdict(STATS), dataclasses.asdict(COSTS))
    assert line == ("KV tiers: host 30/64 blocks, 12 hits; disk 200/5000 blocks, 7 hits; 90 saved, 40 spilled; "
                    "a hit costs 2% (host), 30% (disk) of recomputing; failed: corrupt 2, write failed 1")
