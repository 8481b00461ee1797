"""How big a replica's KV tiers are and where its disk tier's files go: the plan every rank builds its tier storage
from (engine/kv/tier_store.py) and the scheduler sizes its tier indexes by (engine/core/kv_tiers.py). Torch-free."""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.kv.disk_blocks import HEADER_BYTES

FOLDER_PREFIX = "tandem-kv-"  # a replica's disk tier folder: tandem-kv-<pid>-<random>, one rank<r> folder per rank


@dataclass(frozen=True)
class TierPlan:
    """What every rank of a replica builds its tier storage from: host slots (blocks), disk slots (blocks, 0: no
    disk tier) and the replica's disk folder (each rank writes under folder/rank<r>)."""

    host_slots: int
    disk_slots: int = 0
    disk_folder: str | None = None

    def rank_folder(self, rank: int) -> Path | None:
        return None if self.disk_folder is None else Path(self.disk_folder) / f"rank{rank}"


def plan_tiers(host_bytes: int, disk_path: str | None, disk_bytes: int | None, block_bytes: int,
               num_ranks: int) -> TierPlan:
    """Slots the budgets buy for blocks of block_bytes (the whole replica's: every layer and KV head) and, with a
    disk tier, a new folder for this replica under disk_path (created; folders of replicas whose process is gone are
    removed first). Raises ValueError for a budget that holds no block or a disk_path that cannot be written."""
    host_slots = host_bytes // block_bytes
    if host_slots < 1:
        raise ValueError(f"kv_tiers host_bytes ({host_bytes}) holds no KV block of {block_bytes} bytes; raise it")
    if disk_path is None or disk_bytes is None:
        return TierPlan(host_slots)
    disk_slots = disk_bytes // (block_bytes + HEADER_BYTES * num_ranks)
    if disk_slots < 1:
        raise ValueError(f"kv_tiers disk_bytes ({disk_bytes}) holds no KV block of {block_bytes} bytes; raise it")
    root = Path(disk_path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_orphan_folders(root)
        folder = root / f"{FOLDER_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        folder.mkdir()
    except OSError as e:
        raise ValueError(f"kv_tiers disk_path {disk_path!r} cannot be used: {e.strerror or e}") from e
    return TierPlan(host_slots, disk_slots, str(folder))


def remove_orphan_folders(root: Path) -> list[Path]:
    """Deletes the disk tier folders under root whose replica process no longer runs (a replica killed before it
    could clean up). Returns them."""
    removed = []
    for folder in root.glob(f"{FOLDER_PREFIX}*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-")[0]
        if pid.isdigit() and not _process_runs(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
