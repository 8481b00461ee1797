"""Pinning replicas to host CPUs (engine/hardware/cpu_affinity.py): CPU lists parse and split as the manifest documents,
pin_process pins every thread of a process (those started before it and after it), and the ranks of a real
two-rank replica each run on their own share while the driver holds the whole list.

Pinning happens in child processes (a subprocess, the replica's ranks), so this test process keeps its CPUs;
the one test that builds a replica here pins this process and restores it afterwards."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.engine.engine_config import EngineConfig
from tandem.engine.hardware.cpu_affinity import (current_cpus, format_cpus, offered_cpus, parse_cpu_list, pin_process,
                                        pinned_threads, split_cpus)
from tandem.engine.parallel import ParallelConfig
from tandem.replica.spec import ReplicaSpec
from tests.engine.probe_agent import ProbeAgent

OFFERED = sorted(offered_cpus())


@pytest.mark.parametrize("value, expected", [
    ([0], (0,)), ([3, 1, 3, 0], (0, 1, 3)), ((2,), (2,)), ("0", (0,)), ("0-3,8", (0, 1, 2, 3, 8)),
    (" 8, 0-1 ,1", (0, 1, 8)), ("4-4", (4,)),
])
def test_cpu_lists_parse_to_sorted_unique_cpus(value, expected):
    assert parse_cpu_list(value) == expected
    assert parse_cpu_list(format_cpus(expected)) == expected


@pytest.mark.parametrize("value, message", [
    ([], "an empty CPU list pins nothing"),
    ("", "'' is not a CPU list"),
    ([-1], "CPU numbers are 0 or more, got -1"),
    ("-1", "'-1' is not a CPU list"),
    ("0-", "'0-' is not a CPU list"),
    ("0,,1", "'0,,1' is not a CPU list"),
    ("a-b", "'a-b' is not a CPU list"),
    ("3-1", "'3-1' in '3-1' is a reversed range: write it low-high (1-3)"),
    ("0-99999", "CPU 99999 is beyond Linux's largest CPU number (8191)"),
    ([True], "CPU numbers are integers, got True"),
    ([1.0], "CPU numbers are integers, got 1.0"),
    (3, "expected a list of CPU numbers ([0, 1]) or a cpulist string"),
])
def test_bad_cpu_lists_say_what_is_wrong(value, message):
    with pytest.raises(ValueError) as info:
        parse_cpu_list(value)
    assert message in str(info.value)


def test_format_cpus_writes_runs():
    assert format_cpus([8, 0, 1, 2, 3, 5, 2]) == "0-3,5,8"
    assert format_cpus([7]) == "7"


def test_ranks_split_the_list_in_contiguous_shares_in_rank_order():
    assert split_cpus((0, 1), 2) == ((0,), (1,))
    assert split_cpus((0, 1, 2, 3, 8, 9), 3) == ((0, 1), (2, 3), (8, 9))
    assert split_cpus((4, 5), 1) == ((4, 5),)
    with pytest.raises(ValueError, match=r"3 CPU\(s\) \(0-2\) do not split evenly over 2 ranks"):
        split_cpus((0, 1, 2), 2)


def test_more_threads_than_pinned_cpus_are_cut_to_the_cpus_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.engine.hardware.cpu_affinity"):
        assert pinned_threads(4, None, "rank 0") == 4  # not pinned: as asked
        assert pinned_threads(2, (0, 1, 2), "rank 0") == 2
        assert caplog.records == []
        assert pinned_threads(4, (2, 3), "rank 1") == 2
    assert caplog.messages == ["rank 1: 4 threads but pinned to 2 CPU(s) (2-3): running 2"]


PIN = """
import json, os, sys, threading
from tandem.engine.hardware.cpu_affinity import pin_process

def affinity(tid):
    return sorted(os.sched_getaffinity(tid))

release = threading.Event()
started = threading.Event()
seen = {}

def worker(name):
    seen[name] = threading.get_native_id()
    started.set()
    release.wait()

before = threading.Thread(target=worker, args=("before",))
before.start()
started.wait()
pinned = pin_process(json.loads(sys.argv[1]))
started.clear()
after = threading.Thread(target=worker, args=("after",))
after.start()
started.wait()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(json.dumps({"pinned": pinned, "before": affinity(seen["before"]), "after": affinity(seen["after"]),
                  "main": affinity(0), "all": sorted({tuple(affinity(t)) for t in tids}), "threads": len(tids)}))
release.set()
"""


def _pin_in_child(cpus: list[int]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(PIN), json.dumps(cpus)], capture_output=True,
                          text=True, timeout=60)


def test_pin_process_pins_threads_started_before_and_after_it_in_a_child_process():
    target = [OFFERED[-1]]  # with several CPUs, one the child would otherwise not be limited to
    done = _pin_in_child(target)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["main"] == report["before"] == report["after"] == target
    assert report["all"] == [target], "every thread of the process"
    assert report["pinned"] == 2 and report["threads"] == 3  # main and `before` then; `after` inherited it
    assert sorted(os.sched_getaffinity(0)) == OFFERED, "this test process is untouched"


def test_pin_process_refuses_cpus_this_host_does_not_offer_and_pins_nothing():
    absent = max(OFFERED) + 1
    with pytest.raises(ValueError) as info:
        pin_process([OFFERED[0], absent, absent + 2])
    assert f"CPU(s) {absent},{absent + 2} are not offered to this process" in str(info.value)
    assert f"it may use CPUs {format_cpus(OFFERED)}" in str(info.value)
    assert sorted(os.sched_getaffinity(0)) == OFFERED
    with pytest.raises(ValueError, match="empty CPU list"):
        pin_process([])


def test_the_module_is_torch_free():
    """The manifest and `tandem validate` import it: it must not pull in the runtime."""
    code = ("import sys, tandem.engine.hardware.cpu_affinity\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture
def restore_affinity():
    """Gives this process back the CPUs it had (every thread) after a test that pins it."""
    saved = tuple(sorted(os.sched_getaffinity(0)))
    yield
    pin_process(saved)


def test_a_two_rank_replica_pins_each_rank_to_its_share_and_its_driver_to_the_list(tiny_llama, restore_affinity,
                                                                                  caplog):
    if len(OFFERED) < 2:
        pytest.skip(f"needs 2 CPUs, this process may use {format_cpus(OFFERED)}")
    cpus = tuple(OFFERED[:2])
    spec = ReplicaSpec(model=str(tiny_llama.source), device="cpu", engine=EngineConfig(num_kv_blocks=16),
                       parallel=ParallelConfig(tp=2, collective_timeout_s=30), threads=4, cpu_affinity=cpus)
    with caplog.at_level(logging.WARNING, logger="tandem.engine.hardware.cpu_affinity"):
        engine = spec.build(kv_agent=ProbeAgent)
    try:
        assert [(p.rank, p.cpus) for p in engine.rank_placements] == [(0, cpus[:1]), (1, cpus[1:])]
        assert current_cpus() == cpus, "the driver (this process here) holds the whole list"
        # 4 threads for the replica on 2 CPUs: 2, split over 2 ranks: 1 thread each, every thread on its CPU
        assert caplog.messages == [f"replica: 4 threads but pinned to 2 CPU(s) ({format_cpus(cpus)}): running 2"]
        threads = engine.call_kv_agents(ProbeAgent.threads, {0: (), 1: ()})
        for rank, (torch_threads, by_thread) in threads.items():
            assert torch_threads == 1
            assert set(by_thread.values()) == {(cpus[rank],)}, f"rank {rank}: every thread on its share"
        assert len(threads[0][1]) > 1, "the rank's own threads (gloo, ...) count too"
    finally:
        engine.shutdown()
