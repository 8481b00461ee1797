"""What one engine replica is (model, device and precision, engine limits, parallel split) as a picklable value,
and how it is built: the replica shell (replica/shell.py) builds its engine from the ReplicaSpec the control plane
sends."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tandem.engine.engine_config import EngineConfig
from tandem.engine.hardware.cpu_affinity import format_cpus, pin_process, pinned_threads, split_cpus
from tandem.engine.hardware.device import DeviceChoice, resolve_device, split_gpu_ids
from tandem.engine.parallel.layout import ParallelConfig

_log = logging.getLogger(__name__)


def ray_gpu_ids() -> list[str] | None:
    """The GPU IDs Ray assigned to this process (its actor's num_gpus), None outside a Ray worker."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return [str(i) for i in ray.get_gpu_ids()]


@dataclass(frozen=True)
class ReplicaSpec:
    """model: a Hugging Face folder or .gguf path (None: the embedded model). device: engine/hardware/device.py DEVICES
    (auto: CUDA when Ray gave the replica GPUs); dtype None: the device's default; weights: how projections are
    held (engine_config.WEIGHT_FORMATS; all but dense need dtype bfloat16); load_format: where the weights come
    from (engine_config.LOAD_FORMATS: the model's files, or dummy ones of its shapes). threads: torch CPU threads for
    the whole replica (split over its ranks). cpu_affinity: host CPUs to pin the replica to (None: no pinning):
    its driver process takes the whole list, rank r of several the r-th equal share (engine/hardware/cpu_affinity.py);
    len(cpu_affinity) must be a multiple of the world size. lora_adapters: the LoRA adapters it serves once built
    (engine.lora must be set; a bad one fails the build with the reason)."""

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    weights: str = "dense"  # engine_config.WEIGHT_FORMATS
    load_format: str = "auto"  # engine_config.LOAD_FORMATS: dummy makes weights of the model's shapes
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    threads: int = 1
    cpu_affinity: tuple[int, ...] | None = None
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) served from the start (engine.lora set)

    def choose_device(self, gpu_ids: list[str] | None) -> DeviceChoice:
        """This replica's device and dtype, given the GPU IDs Ray assigned it (None outside Ray). Raises
        ValueError when CUDA is asked for or implied and cannot be had."""
        import torch

        return resolve_device(self.device, self.dtype, gpu_ids, torch.cuda.device_count(),
                              f"torch {torch.__version__}")

    def build(self, kv_agent=None, event_sink=None):
        """Loads the model (only its config and tokenizer when the ranks load their own shards) onto the chosen
        device and returns a running LLMEngine publishing its KV events to event_sink (None: nowhere). A replica
        of several ranks gives each rank its share of the GPUs Ray assigned it (CUDA_VISIBLE_DEVICES). With
        cpu_affinity, pins this whole process (every thread) to it first, and runs no more torch threads than it
        has CPUs: this process is the replica's driver. Raises ModelLoadError / ValueError (also for CPUs this
        host does not offer) / ReplicaFailedError like LLMEngine."""
        import torch

        from tandem.engine.kv.kv_events import discard_events
        from tandem.engine.core.llm_engine import LLMEngine
        from tandem.engine.loader import load_model

        world_size = self.parallel.world_size
        rank_cpus = None
        if self.cpu_affinity is not None:
            rank_cpus = split_cpus(self.cpu_affinity, world_size) if world_size > 1 else None
            pin_process(self.cpu_affinity)
            _log.info("replica pinned to CPUs %s%s", format_cpus(self.cpu_affinity),
                      f"; ranks' CPUs {[format_cpus(c) for c in rank_cpus]}" if rank_cpus else "")
        # Several ranks split these threads (and, pinned, the CPUs) evenly, so the cut carries over to each rank.
        torch.set_num_threads(pinned_threads(self.threads, self.cpu_affinity, "replica"))
        gpu_ids = ray_gpu_ids()
        # Several ranks: each child process sees only its share. One rank: this process already sees only the
        # replica's GPUs (Ray set CUDA_VISIBLE_DEVICES for the actor).
        rank_gpus = split_gpu_ids(gpu_ids, world_size) if gpu_ids is not None and world_size > 1 else None
        choice = self.choose_device(gpu_ids if rank_gpus is None else [g for g in rank_gpus[0].split(",") if g])
        _log.info("replica device: %s%s", choice.describe(),
                  f"; ranks' GPUs {list(rank_gpus)}" if rank_gpus else
                  f"; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}" if gpu_ids else "")
        loaded = load_model(self.model, dtype=getattr(torch, choice.dtype), device=choice.device, progress=False,
                            weights=world_size == 1, weight_format=self.weights, load_format=self.load_format)
        engine = LLMEngine(loaded, self.engine, parallel=self.parallel, kv_agent=kv_agent,
                           event_sink=event_sink or discard_events, rank_gpus=rank_gpus, rank_cpus=rank_cpus)
        try:
            for name, path in self.lora_adapters:
                engine.load_lora(name, path)
        except BaseException:
            engine.shutdown()
            raise
        return engine
