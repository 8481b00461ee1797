"""Which device and dtype a rank computes on, decided once from what the manifest asks for and what the rank was
given, and where each rank of a replica ended up. Plain Python: no torch, so the manifest checks and the router
side can use it.

A rank is "given" GPUs by Ray (the IDs Ray assigned to its replica's placement, one share per rank, exported to
the rank as CUDA_VISIBLE_DEVICES) or, outside Ray, by whatever CUDA devices its process can see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DEVICES = ("auto", "cpu", "cuda")  # auto: CUDA when the rank was given a GPU, else the CPU
DTYPES = ("float32", "bfloat16")


def default_dtype(device_type: str) -> str:
    """bfloat16 on CUDA (tensor cores, half the bytes), float32 on the CPU (matches transformers to 1e-3)."""
    return "bfloat16" if device_type == "cuda" else "float32"


def planned_device(requested: str, gpus_per_rank: float) -> str:
    """The device a pool's ranks will use, as far as the manifest says: cuda when asked, or under auto when each
    rank asks Ray for a GPU share."""
    return "cuda" if requested == "cuda" or (requested == "auto" and gpus_per_rank > 0) else "cpu"


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "cpu" or "cuda"
    dtype: str  # one of DTYPES
    reason: str  # why this device, for the log line

    def describe(self) -> str:
        return f"{self.device} {self.dtype} ({self.reason})"


def resolve_device(requested: str, dtype: str | None, gpu_ids: Sequence[str] | None,
                   cuda_devices: int, torch_version: str = "torch") -> DeviceChoice:
    """requested: one of DEVICES. dtype None: default_dtype of the device. gpu_ids: the GPUs Ray gave this
    replica (None outside Ray: any device the process sees). cuda_devices: CUDA devices torch can use here.
    Raises ValueError naming what is missing when cuda is asked for (or implied by a GPU under auto) and cannot
    be had."""
    if requested not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    given = bool(gpu_ids) if gpu_ids is not None else cuda_devices > 0
    if requested == "cpu":
        device, reason = "cpu", "device: cpu"
    elif requested == "cuda" and gpu_ids is not None and not gpu_ids:
        raise ValueError("device: cuda, but Ray gave this replica no GPU: give its ranks one "
                         "(pool resources: {gpus: 1}) or set device: cpu")
    elif requested == "cuda" or given:
        if cuda_devices == 0:
            what = f"Ray gave it GPU {','.join(gpu_ids)}" if gpu_ids else "device: cuda"
            raise ValueError(f"{what}, but {torch_version} sees no CUDA device (a CPU build of torch, or no "
                             "driver): install a CUDA build of torch on this node, or set device: cpu")
        device = "cuda"
        reason = "device: cuda" if requested == "cuda" else f"auto: given GPU {','.join(gpu_ids or ['0'])}"
    else:
        device, reason = "cpu", "auto: no GPU given"
    return DeviceChoice(device, dtype or default_dtype(device), reason)


def split_gpu_ids(gpu_ids: Sequence[str], world_size: int) -> tuple[str, ...]:
    """Each rank's CUDA_VISIBLE_DEVICES from the GPU IDs Ray gave the whole replica: an equal share each, in
    rank order ("" when none were given). A single rank with a fraction of a GPU gets that GPU. Raises
    ValueError if the GPUs do not split evenly over the ranks."""
    ids = [str(i) for i in gpu_ids]
    if not ids:
        return ("",) * world_size
    if len(ids) % world_size:
        raise ValueError(f"{len(ids)} GPU(s) ({','.join(ids)}) do not split evenly over {world_size} ranks; "
                         "give each rank whole GPUs (resources.gpus: 1)")
    share = len(ids) // world_size
    return tuple(",".join(ids[r * share:(r + 1) * share]) for r in range(world_size))


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of a replica runs, as the rank itself reports it."""

    rank: int
    pid: int
    device: str  # the torch device it computes on, e.g. "cuda:0" or "cpu"
    visible_gpus: str | None  # its CUDA_VISIBLE_DEVICES (None: not set)
    attention: str = ""  # the attention backend it runs and why, e.g. "triton (cuda)"
    cpus: tuple[int, ...] | None = None  # the host CPUs it may run on (os.sched_getaffinity; None: not Linux)
    decode_step: str = ""  # compiled or eager, and why (engine/models/compiled.py decode_step_summary)
