"""The soak under chaos in its short form (bench/soak.py --minutes 2; `make soak` runs 10): open-loop load on the
local disaggregated cluster while ranks are killed, KV connections dropped, the router killed or a replica
stalled. Every request ends with the one-process tokens or a documented error, none is lost, no replica holds a
block afterwards, and memory does not grow past 10%."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.cluster import local_ray

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_ray_running():
    deadline = time.monotonic() + 15
    while local_ray.ray_processes_running():
        if time.monotonic() > deadline:
            pytest.fail("a Ray cluster is already running on this machine; the soak starts and stops its own")
        time.sleep(0.5)
    yield
    if (head := local_ray.recorded()) is not None:
        local_ray.stop(head, grace_s=2.0)


def test_a_two_minute_soak_under_chaos_loses_nothing_and_leaks_nothing(no_ray_running):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "2", "--chaos-every",
                           "15", "25"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({k: report[k] for k in ("requests", "outcomes", "failed_by_code", "chaos", "memory")},
                     indent=1))
    assert report["requests"] >= 30 and report["outcomes"]["identical"] > 0
    assert len(report["chaos"]) >= 3 and any("did" in entry for entry in report["chaos"])
    assert not report["violations"], report["violations"]
    assert not report["replicas_still_busy"] and not report["integrity_errors"]
    assert report["ok"], report
