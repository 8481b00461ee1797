"""Pinning a replica's processes to host CPUs (a pool's `cpu_affinity` in the manifest): parsing a CPU list,
splitting it over a replica's ranks, and pinning every thread of a process. Plain Python (no torch), so the
manifest and `tandem validate` use it too. Linux only: elsewhere pin_process refuses and current_cpus() is None.

A replica's driver (its actor process) is pinned to the whole list; rank r of a replica of world size W takes
the r-th of W equal contiguous shares (split_cpus). Threads a process starts after pin_process() inherit its
CPUs, so pinning before torch builds its thread pool covers the pool too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable

_log = logging.getLogger(__name__)

MAX_CPUS = 8192  # Linux's largest NR_CPUS: a CPU number at or above it is a typo, not a machine


def parse_cpu_list(value: object) -> tuple[int, ...]:
    """A CPU list as the manifest gives it, a list of CPU numbers ([0, 1]) or a Linux cpulist string ("0-3,8",
    as in /sys/devices/system/cpu/online or `taskset -c`), as a sorted tuple of unique CPU numbers. Raises
    ValueError, saying what is wrong, for an empty list, a negative or too large number, a reversed range, or
    anything else."""
    if isinstance(value, str):
        cpus = _parse_cpulist_string(value)
    elif isinstance(value, (list, tuple)):
        cpus = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise ValueError(f"CPU numbers are integers, got {item!r}")
            cpus.append(item)
    else:
        raise ValueError(f'expected a list of CPU numbers ([0, 1]) or a cpulist string ("0-3,8"), got {value!r}')
    if not cpus:
        raise ValueError("an empty CPU list pins nothing: list at least one CPU, or leave cpu_affinity out (null)")
    if bad := [c for c in cpus if c < 0]:
        raise ValueError(f"CPU numbers are 0 or more, got {bad[0]}")
    if bad := [c for c in cpus if c >= MAX_CPUS]:
        raise ValueError(f"CPU {bad[0]} is beyond Linux's largest CPU number ({MAX_CPUS - 1})")
    return tuple(sorted(set(cpus)))


def _parse_cpulist_string(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not _is_number(first) or (dash and not _is_number(last)):
            raise ValueError(f'{text!r} is not a CPU list: expected CPU numbers and ranges such as "0-3,8"')
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{part!r} in {text!r} is a reversed range: write it low-high ({high}-{low})")
        if high >= MAX_CPUS:
            raise ValueError(f"CPU {high} is beyond Linux's largest CPU number ({MAX_CPUS - 1})")
        cpus += range(low, high + 1)
    return cpus


def _is_number(text: str) -> bool:
    text = text.strip()
    return text.isascii() and text.isdigit()


def format_cpus(cpus: Iterable[int]) -> str:
    """CPU numbers as a cpulist string ("0-3,8"), the inverse of parse_cpu_list."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    start = None
    for i, cpu in enumerate(ordered):
        if start is None:
            start = cpu
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            runs.append(str(cpu) if cpu == start else f"{start}-{cpu}")
            start = None
    return ",".join(runs)


def split_cpus(cpus: tuple[int, ...], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's CPUs, in rank order: rank r gets the r-th of world_size equal contiguous shares of cpus (as
    given, normally sorted). Raises ValueError if len(cpus) is not a multiple of world_size."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if len(cpus) % world_size:
        raise ValueError(f"{len(cpus)} CPU(s) ({format_cpus(cpus)}) do not split evenly over {world_size} ranks: "
                         f"list a multiple of {world_size} CPUs, the same number for each rank")
    share = len(cpus) // world_size
    return tuple(tuple(cpus[r * share:(r + 1) * share]) for r in range(world_size))


def offered_cpus() -> frozenset[int]:
    """The CPUs a process on this host may be pinned to: the cgroup's cpuset where one limits it (containers,
    Kubernetes), else every CPU the OS counts. Not the process's own affinity: a process started on one core
    (a benchmark that keeps its router off the decode core, `taskset`) may still pin its replicas elsewhere."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return frozenset(parse_cpu_list(text))
    return frozenset(range(os.cpu_count() or 1))


def current_cpus() -> tuple[int, ...] | None:
    """The CPUs the calling thread may run on, sorted (None where the OS does not say: not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_process(cpus: Iterable[int]) -> int:
    """Pins every thread of this process to cpus, and so every thread it starts later (threads inherit their
    creator's CPUs). Returns how many threads were pinned. cpus must lie within offered_cpus() (the
    host's, or its cgroup's). Raises ValueError naming the CPUs this process is not offered (nothing is
    pinned then), or when the OS cannot pin (not Linux)."""
    wanted = frozenset(cpus)
    if not wanted:
        raise ValueError("cannot pin to an empty CPU list")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpu_affinity needs Linux (os.sched_setaffinity); leave it out on this platform")
    offered = offered_cpus()
    if missing := wanted - offered:
        raise ValueError(f"CPU(s) {format_cpus(missing)} are not offered to this process on this host (it may "
                         f"use CPUs {format_cpus(offered)}): fix the pool's cpu_affinity")
    os.sched_setaffinity(0, wanted)  # this thread first: threads it starts from now on inherit the new CPUs
    pinned: set[int] = set()
    while True:  # a thread started meanwhile by one not yet pinned shows up in the next listing
        fresh = {int(tid) for tid in os.listdir("/proc/self/task")} - pinned
        if not fresh:
            return len(pinned)
        for tid in fresh:
            try:
                os.sched_setaffinity(tid, wanted)
            except ProcessLookupError:  # it ended since the listing
                pass
        pinned |= fresh


def pinned_threads(threads: int, cpus: tuple[int, ...] | None, who: str) -> int:
    """How many compute threads a process pinned to cpus (None: not pinned) should run: threads, but no more
    than it has CPUs, since more threads than pinned cores only take turns on them. Logs a warning naming
    `who` when it cuts the count."""
    threads = max(1, threads)
    if cpus is None or len(cpus) >= threads:
        return threads
    _log.warning("%s: %d threads but pinned to %d CPU(s) (%s): running %d", who, threads, len(cpus),
                 format_cpus(cpus), len(cpus))
    return len(cpus)
