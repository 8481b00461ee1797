"""One rank's KV tier storage: its host slots (engine/kv/host_blocks.py) and its disk folder (engine/kv/disk_blocks.py),
and the step's tier copies (SchedulerOutput.tier_ops, written by engine/core/kv_tiers.py) run over them in order.

Every rank holds its own share of each block (its layers and KV heads), so every rank runs the same copies on its
share: the same slots, its own files (folder/rank<r>). A copy that touches the disk can fail; run() reports
(block hash, reason) for each, and a LoadBlocks run stops before the first block whose fetch failed in this step.
A failed write is logged with its reason: the block is simply not on disk (a later read of it is a miss).

start() runs ops[:sync] now and the rest on this store's copy thread (a side CUDA stream on a GPU), so they overlap
the model's step; wait() returns when all are done, with the failures and the time each copy up took (the router
weighs a hit on each tier by them: engine/core/kv_tiers.py, hit_costs()).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from tandem.engine.kv.disk_blocks import DiskTierError, read_block, remove_block, write_block
from tandem.engine.kv.host_blocks import HostBlockStore
from tandem.engine.kv.kv_events import DISK, HOST
from tandem.engine.kv.kv_cache import PagedKVCache
from tandem.engine.scheduler_output import (DropBlock, FetchBlock, LoadBlocks, SaveBlocks, SpillBlock, TierOp,
                                            TierOps, TierReport)

log = logging.getLogger(__name__)

Failures = list[tuple[int, str]]


class TierStore:
    """host_slots blocks of `cache`'s shape in host memory (page-locked when the cache is on a GPU) and, with
    disk_folder, that folder for the disk tier's files (created; remove() deletes it)."""

    def __init__(self, cache: PagedKVCache, host_slots: int, disk_folder: Path | None = None):
        self.cache = cache
        on_gpu = cache.data.device.type == "cuda"
        self.host = HostBlockStore(cache.spec, host_slots, pin=on_gpu)
        self.folder = disk_folder
        if disk_folder is not None:
            disk_folder.mkdir(parents=True, exist_ok=True)
        self._stream = torch.cuda.Stream(cache.data.device) if on_gpu else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-copies")
        self._running: Future | None = None
        self._failures: Failures = []
        self._times: list[tuple[str, int, float]] = []  # (tier, blocks, seconds) of each copy up this step

    @property
    def block_bytes(self) -> int:
        return self.host.data[0].numel() * self.host.data.element_size()

    def start(self, tier_ops: TierOps) -> None:
        """Runs tier_ops.ops[:sync] now, then the rest on the copy thread. Call wait() before the next start()."""
        if self._running is not None:
            raise RuntimeError("the previous step's tier copies were not waited for")
        self._failures = self._run(tier_ops.ops[:tier_ops.sync], set())
        if len(tier_ops.ops) > tier_ops.sync:
            failed = {h for h, _ in self._failures}
            self._running = self._thread.submit(self._run, tier_ops.ops[tier_ops.sync:], failed)

    def wait(self) -> TierReport:
        """Blocks until the started copies are done: the (block hash, reason) of each disk copy that failed, and
        how long each copy up took."""
        failures, self._failures = self._failures, []
        if self._running is not None:
            running, self._running = self._running, None
            failures += running.result()
        times, self._times = self._times, []
        return TierReport(tuple(failures), tuple(times))

    def _run(self, ops: Sequence[TierOp], failed: set[int]) -> Failures:
        failures: Failures = []
        if not ops:
            return failures
        with torch.inference_mode(), (torch.cuda.stream(self._stream) if self._stream is not None
                                      else contextlib.nullcontext()):
            for op in ops:
                if isinstance(op, SaveBlocks):
                    self.host.save(self.cache, list(op.blocks), list(op.slots), non_blocking=self._stream is not None)
                elif isinstance(op, LoadBlocks):
                    run = next((i for i, h in enumerate(op.hashes) if h in failed), len(op.hashes))
                    self._sync()  # timed from here: the copy thread waits, the model does not
                    start = time.perf_counter()
                    self.host.load(self.cache, list(op.slots[:run]), list(op.blocks[:run]),
                                   non_blocking=self._stream is not None)
                    self._sync()
                    if run:
                        self._times.append((HOST, run, time.perf_counter() - start))
                else:
                    self._sync()  # the host slot a disk copy reads or writes is final
                    start = time.perf_counter()
                    problem = self._disk(op)
                    if problem is not None:
                        failures.append((op.block_hash, problem))
                        failed.add(op.block_hash)
                    elif isinstance(op, FetchBlock):
                        self._times.append((DISK, 1, time.perf_counter() - start))
            self._sync()
        return failures

    def _disk(self, op: SpillBlock | FetchBlock | DropBlock) -> str | None:
        """One disk copy; the reason it failed, or None."""
        if self.folder is None:
            return "no disk tier"
        if isinstance(op, DropBlock):
            remove_block(self.folder, op.block_hash)
            return None
        if isinstance(op, SpillBlock):
            try:
                write_block(self.folder, op.block_hash, self.host.payload(op.slot))
            except DiskTierError as e:
                log.warning("KV disk tier: %s; the block will be recomputed when asked for", e)
                return f"write failed: {e.strerror or e}"
            return None
        read = read_block(self.folder, op.block_hash, self.block_bytes)
        if read.payload is None:
            log.warning("KV disk tier: block %#x is %s in %s; recomputing it", op.block_hash, read.problem,
                        self.folder)
            return read.problem
        self.host.fill(op.slot, read.payload)
        return None

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self, remove: bool = True) -> None:
        """Stops the copy thread and (remove) deletes this rank's disk folder."""
        self._thread.shutdown(wait=True)
        if remove and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
