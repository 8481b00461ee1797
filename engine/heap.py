"""A long-lived server process's garbage-collected heap: what it builds before it serves (imported libraries, the
tokenizer, the model and its graphs) lives until it ends, so once started the process freezes it (settle()) and
later full collections scan only what came after; and the collector's pauses, measured (GCPauses).

Why: CPython's cyclic collector holds the GIL while it scans, on whichever thread allocated last, so one full
collection stalls every thread of the process: a router's event loop, a replica's step loop. Its cost grows with
the number of tracked objects (about 0.5 s per million on a 2-core EPYC). A router holds ~0.1 M at its start (a full
collection: 55 ms), a replica with the embedded model ~0.2 M (112 ms), and a process that lived through a thousand
tests, many millions: there one full collection held the router's loop for 7-13 s in the middle of a 200-stream
burst (issue 48, item 5; bench/gc_pauses.py measures both processes). A frozen object still goes when its last
reference does; only a reference cycle of frozen objects stays until the process ends, which is why only the
start-up heap of a process that serves until it ends is frozen, never a test's or a library user's.

Plain Python, no torch: the router imports it."""

from __future__ import annotations

import bisect
import gc
import threading
import time
from dataclasses import dataclass

PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def settle() -> int:
    """Collects what is garbage now, then moves every surviving tracked object to the collector's permanent
    generation, where no later collection scans it. Call it once the process has built what it serves with. Returns
    how many objects are frozen in all (gc.get_freeze_count())."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass(frozen=True)
class Pauses:
    """One generation's collections: how many, their seconds in all, the longest, and a cumulative count per
    PAUSE_BUCKETS bound (Prometheus histogram buckets; the +Inf bucket is `count`)."""

    count: int
    seconds: float
    longest: float
    buckets: tuple[int, ...]


class GCPauses:
    """The collector's pauses per generation (0, 1, 2: 2 is a full collection), measured through gc.callbacks.
    install() adds it once per process; pauses() reads it from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started: float | None = None
        self._count = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]
        self._longest = [0.0, 0.0, 0.0]
        self._buckets = [[0] * len(PAUSE_BUCKETS) for _ in range(3)]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        took, self._started = time.perf_counter() - self._started, None
        g = info["generation"]
        with self._lock:
            self._count[g] += 1
            self._seconds[g] += took
            self._longest[g] = max(self._longest[g], took)
            for i in range(bisect.bisect_left(PAUSE_BUCKETS, took), len(PAUSE_BUCKETS)):
                self._buckets[g][i] += 1

    def pauses(self) -> dict[int, Pauses]:
        """generation -> what its collections paused so far."""
        with self._lock:
            return {g: Pauses(self._count[g], self._seconds[g], self._longest[g], tuple(self._buckets[g]))
                    for g in range(3)}


_installed: GCPauses | None = None
_install_lock = threading.Lock()


def gc_pauses() -> GCPauses:
    """This process's pause clock, installed in gc.callbacks on the first call."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = GCPauses()
            gc.callbacks.append(_installed)
        return _installed
