"""engine/heap.py: settle() frees what is garbage and freezes what lives; GCPauses counts each generation's pauses
into cumulative buckets."""

from __future__ import annotations

import gc
import weakref

from tandem.engine.heap import PAUSE_BUCKETS, GCPauses, gc_pauses, settle


class Node:
    def __init__(self):
        self.other = None


def test_settle_frees_garbage_cycles_and_freezes_what_lives():
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    kept = Node()
    del a, b
    frozen = settle()
    assert gone() is None, "a garbage cycle must be collected before the freeze, not frozen"
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects()), "a live object is frozen: no collection scans it"
    assert gc.is_tracked(kept)


def test_gc_pauses_counts_each_generation_into_cumulative_buckets():
    clock = GCPauses()
    gc.callbacks.append(clock)
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        gc.callbacks.remove(clock)
    pauses = clock.pauses()
    assert pauses[0].count >= 1 and pauses[2].count == 2
    full = pauses[2]
    assert 0 < full.seconds and full.longest <= full.seconds
    assert list(full.buckets) == sorted(full.buckets) and full.buckets[-1] <= full.count
    assert len(full.buckets) == len(PAUSE_BUCKETS)
    # a phase "stop" without its "start" (a clock installed mid-collection) is ignored
    clock("stop", {"generation": 1})
    assert clock.pauses()[1].count == pauses[1].count


def test_the_process_clock_is_installed_once():
    assert gc_pauses() is gc_pauses()
    assert sum(c is gc_pauses() for c in gc.callbacks) == 1
    before = gc_pauses().pauses()[2].count
    gc.collect()
    assert gc_pauses().pauses()[2].count == before + 1
