"""Kernel choice by measurement: time the candidate implementations of a product on this CPU, keep the fastest.

Which kernel streams a weight fastest depends on the CPU (AVX2 or AVX-512, its caches, its memory), the torch
build and the thread count: a choice tuned on one machine loses on another (docs/BENCHMARKS.md). So each kernel
family (engine/models/linear.py for projections, engine/attention/torch_ref.py for decode attention) names its
candidates and how to time them, and this module runs the timing once per machine and keeps the answer:

- on disk, one JSON file per machine key (CPU model, torch's capability, the kernel flags, what the probe found
  and what TANDEM_CPU_DISABLE turned off, ONEDNN_MAX_CPU_ISA, torch version and thread count), under
  `$TANDEM_CACHE_DIR/kernels` (default `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`), so a process starts
  with the answers of the last one on the same machine;
- behind a file lock while measuring, so that the ranks of a replica starting together take turns instead of
  timing each other's load (a rank that waited reads what the other measured).

Settings (read once, where a KernelTuner is built from the environment; rank processes and Ray workers inherit
them): TANDEM_KERNEL_TUNING=off keeps the probe's fixed choices and times nothing; TANDEM_CACHE_DIR moves the
cache. Deleting the cache file re-measures.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from tandem.engine.hardware.cache_dir import cache_root
from tandem.engine.hardware.cpu_features import FEATURES, CpuFeatures, cpu_model

TUNING_ENV = "TANDEM_KERNEL_TUNING"
FORMAT = 1  # bump when a cached entry's meaning changes: older files are then ignored
# The size of the working set a timing cycles through: well past the caches of the CPUs we run on (32 MiB of L3 on
# the CI machines; at 48 MiB some reads still hit it), so that a product reads its weight from memory, as a decode
# step over many layers does.
COLD_BYTES = 160 << 20

_log = logging.getLogger(__name__)


def machine_key(cpu: CpuFeatures, threads: int) -> dict[str, object]:
    """What a measured choice depends on, as JSON-ready values."""
    return {"cpu_model": cpu_model(), "capability": cpu.capability, "flags": list(cpu.flags),
            "features": {name: getattr(cpu, name) for name in FEATURES},
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "torch": torch.__version__,
            "threads": threads, "format": FORMAT}


def machine_digest(cpu: CpuFeatures, threads: int) -> str:
    """machine_key as a short name: what a file or folder of per-machine answers is called."""
    return hashlib.sha256(json.dumps(machine_key(cpu, threads), sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return cache_root() / "kernels"


def time_per_call(calls: Sequence[Callable[[], object]], repeats: int = 3, budget_s: float = 0.01) -> float:
    """Seconds per call: the best of `repeats` passes over `calls` (each pass runs every call once, as many times
    as fit in budget_s), after one warm-up pass; a single pass when one already takes longer than budget_s.
    Calls over different weights read them from memory, not from a cache a single repeated call would keep them
    in."""
    for call in calls:
        call()
    start = time.perf_counter()
    for call in calls:
        call()
    one_pass = max(time.perf_counter() - start, 1e-7)
    if one_pass >= budget_s:
        repeats = 1
    passes = max(1, min(50, int(budget_s / one_pass)))
    best = one_pass
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(passes):
            for call in calls:
                call()
        best = min(best, (time.perf_counter() - start) / passes)
    return best / len(calls)


def copies_for(nbytes: int) -> int:
    """How many distinct copies of an operand of nbytes a timing cycles through to read from memory."""
    return max(1, min(64, -(-COLD_BYTES // max(nbytes, 1))))


@dataclass(frozen=True)
class BucketPlan:
    """Which kernel runs a product by its size n (rows, sequences): the kernel of the last entry whose from_n is
    at most n. Entries ascend, the first at 1."""

    kernels: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if not self.kernels or self.kernels[0][0] != 1 or any(
                a[0] >= b[0] for a, b in zip(self.kernels, self.kernels[1:])):
            raise ValueError(f"a plan's entries ascend from 1: {self.kernels}")

    def kernel_for(self, n: int) -> str:
        chosen = self.kernels[0][1]
        for from_n, kernel in self.kernels:
            if n < from_n:
                break
            chosen = kernel
        return chosen

    def names(self) -> list[str]:
        return [kernel for _, kernel in self.kernels]

    def describe(self, unit: str) -> str:
        """E.g. "split (1 row), onednn_t (2+ rows)" for unit "row"."""
        parts = []
        for i, (first, kernel) in enumerate(self.kernels):
            last = self.kernels[i + 1][0] - 1 if i + 1 < len(self.kernels) else None
            span = f"{first}+" if last is None else str(first) if last == first else f"{first}-{last}"
            parts.append(f"{kernel} ({span} {unit}{'' if span == '1' else 's'})")
        return ", ".join(parts)

    @classmethod
    def from_buckets(cls, per_bucket: Sequence[str], buckets: Sequence[int]) -> BucketPlan:
        """The plan that runs per_bucket[i] for the sizes nearest (log scale) to buckets[i]."""
        kernels: list[tuple[int, str]] = []
        for i, kernel in enumerate(per_bucket):
            first = 1 if i == 0 else int((buckets[i - 1] * buckets[i]) ** 0.5 + 0.999)
            if not kernels or kernels[-1][1] != kernel:
                kernels.append((first, kernel))
        return cls(tuple(kernels))

    def to_json(self) -> list[list]:
        return [list(k) for k in self.kernels]

    @classmethod
    def from_json(cls, value: list) -> BucketPlan:
        return cls(tuple((int(first), str(kernel)) for first, kernel in value))


class KernelTuner:
    """Measures once per machine key and entry, remembers in memory and on disk. enabled False: choose() is never
    called by the families (they take their fixed choice)."""

    def __init__(self, cpu: CpuFeatures, *, threads: int | None = None, cache_dir: Path | None = None,
                 enabled: bool = True):
        self.cpu = cpu
        self.enabled = enabled
        self.threads = threads or torch.get_num_threads()
        self.key = machine_key(cpu, self.threads)
        self.path = (cache_dir or default_cache_dir()) / f"{machine_digest(cpu, self.threads)}.json"
        self._entries: dict[str, dict] | None = None

    @classmethod
    def from_environment(cls, cpu: CpuFeatures) -> KernelTuner:
        """The tuner the settings describe (TANDEM_KERNEL_TUNING, TANDEM_CACHE_DIR). Raises ValueError for a
        TANDEM_KERNEL_TUNING other than on / off."""
        value = os.environ.get(TUNING_ENV, "on").strip().lower() or "on"
        if value not in ("on", "off"):
            raise ValueError(f"{TUNING_ENV} must be on or off, got {os.environ[TUNING_ENV]!r}")
        return cls(cpu, enabled=value == "on")

    def describe(self) -> str:
        if not self.enabled:
            return f"kernels: the probe's fixed choices ({TUNING_ENV}=off)"
        return f"kernels: measured on this CPU with {self.threads} thread(s), cached in {self.path}"

    def choose(self, entry: str, measure: Callable[[], dict]) -> dict:
        """The cached answer for `entry` (a family's name for what it tunes, e.g. "linear float32 960x576"), or
        measure()'s, which is then cached. measure runs under the cache's file lock."""
        entries = self._load()
        if entry in entries:
            return entries[entry]
        with self._locked():
            entries = self._load(fresh=True)  # another process may have measured it while we waited
            if entry in entries:
                return entries[entry]
            start = time.perf_counter()
            with torch.inference_mode():
                choice = measure()
            seconds = time.perf_counter() - start
            entries[entry] = choice
            self._store(entries)
        _log.info("tuned %s in %.2f s: %s", entry, seconds, choice.get("summary", choice))
        return choice

    def _load(self, fresh: bool = False) -> dict[str, dict]:
        if self._entries is None or fresh:
            try:
                data = json.loads(self.path.read_text())
                self._entries = data["entries"] if data.get("machine") == self.key else {}
            except (OSError, ValueError, KeyError, TypeError):
                self._entries = {}  # none yet, or unreadable: measured again and rewritten
        return self._entries

    def _store(self, entries: dict[str, dict]) -> None:
        """Atomic: a reader sees the old file or the new one, never half of one. An unwritable cache is logged,
        not fatal (the answer still holds for this process)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"machine": self.key, "entries": entries}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            _log.warning("kernel choices not cached (%s): they will be measured again in the next process", e)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_suffix(".lock"), "a")
        except OSError:
            yield  # no writable cache: measure without a lock
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

