"""One rank of a replica, in its own process: loads its shard, holds its share of the KV cache, runs steps.

Start-up: the rank pins itself to the host CPUs the driver names for it (every thread, before torch starts its
thread pool; no more torch threads than those CPUs), takes the GPUs the driver names for it (CUDA_VISIBLE_DEVICES,
before CUDA starts), loads its shard onto its device, answers Memory (its device's free bytes) and waits for
Allocate: the driver sizes every rank's KV cache from the smallest answer. Then it sends Ready (its
RankPlacement).
The driver (engine/runner/ranks/executor.py) sends each message (engine/runner/ranks/messages.py) to every rank over a
pipe: Step (pickled once), GetStats or Stop; and AgentCall to the ranks it names, which run fn(agent, *args) on their
KV transfer agent and answer AgentAnswer. The sampler rank answers each step with StepResult; every rank answers
GetStats with RankStats. A rank that fails sends RankError and exits, which the driver sees at once. Later
issues start the same `run_worker` inside Ray actors.
"""

from __future__ import annotations

import os
import pickle
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tandem.engine.engine_config import LoRAConfig
from tandem.engine.kv.tier_plan import TierPlan
from tandem.engine.hardware.cpu_affinity import current_cpus, pin_process, pinned_threads
from tandem.engine.hardware.device import RankPlacement
from tandem.engine.heap import settle
from tandem.engine.parallel.layout import ReplicaLayout
from tandem.engine.runner.ranks.messages import (AgentAnswer, AgentCall, Allocate, GetStats, Memory, RankError,
                                                 RankStats, Ready, Step, StepResult, Stop)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build itself. model_path None: the embedded model."""

    model_path: str | None
    dtype: str  # "float32" | "bfloat16"
    device: str
    layout: ReplicaLayout
    block_size: int
    max_positions: int
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:PORT
    timeout_s: float
    threads: int
    micro_batches: int
    kv_agent: object = None  # a picklable factory (rank, layout, kv_cache) -> KV transfer agent (kv_transfer/)
    attention_backend: str = "auto"  # engine_config.ATTENTION_BACKENDS
    visible_gpus: tuple[str, ...] | None = None  # each rank's CUDA_VISIBLE_DEVICES (None: inherit; rank r: cuda:r)
    cpus: tuple[tuple[int, ...], ...] | None = None  # each rank's host CPUs (hardware/cpu_affinity.py; None: inherit)
    weight_format: str = "dense"  # engine_config.WEIGHT_FORMATS
    kv_dtype: str = "auto"  # engine_config.KV_CACHE_DTYPES
    load_format: str = "auto"  # engine_config.LOAD_FORMATS: dummy makes this rank's shard on its device
    kv_tiers: TierPlan | None = None  # this replica's KV tiers (engine/core/kv_tiers.py); each rank holds its share
    lora: LoRAConfig | None = None  # LoRA adapters (engine/models/lora.py): each rank holds its shard of each


def run_worker(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """The rank's whole life. Returns on Stop or after reporting an error."""
    comm = agent = None
    try:
        cpus = None if spec.cpus is None else spec.cpus[rank]
        if cpus is not None:  # before torch starts its thread pool: those threads inherit the CPUs
            pin_process(cpus)
        if spec.visible_gpus is not None:  # before torch starts CUDA, which reads it once
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_gpus[rank]
        import torch

        from tandem.engine.attention.triton_backend import select_backend, tune_for
        from tandem.engine.engine_config import available_memory_bytes
        from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache, kv_storage_dtype, store_memory_of
        from tandem.engine.loader.model_loader import keeps_q4_blocks, load_checkpoint
        from tandem.engine.models import build_model
        from tandem.engine.models.lora import LoRASlots
        from tandem.engine.models.compiled import decode_step_summary
        from tandem.engine.parallel.comm import ParallelComm
        from tandem.engine.runner.model_runner import ModelRunner

        torch.set_num_threads(pinned_threads(spec.threads, cpus, f"rank {rank}"))
        layout = spec.layout
        device = spec.device
        if torch.device(device).type == "cuda" and torch.device(device).index is None:
            # One GPU per rank: the only one it sees, or (no list from the driver) the rank-th of this host's.
            device = "cuda:0" if spec.visible_gpus is not None else f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        comm = ParallelComm(layout, rank, init_method=spec.init_method, timeout_s=spec.timeout_s, device=device)
        shard = layout.shard(rank)
        checkpoint = load_checkpoint(spec.model_path, progress=False, load_format=spec.load_format,
                                     packed=keeps_q4_blocks(spec.model_path, spec.weight_format, spec.load_format))
        tokenizer = checkpoint.tokenizer  # the sampler rank's grammar backend reads it (structured output)
        dtype = getattr(torch, spec.dtype)
        model = build_model(checkpoint.config, checkpoint.weights, dtype=dtype, device=device,
                            max_positions=spec.max_positions, source=str(checkpoint.source), shard=shard, comm=comm,
                            weight_format=spec.weight_format)
        del checkpoint
        model.attention = select_backend(spec.attention_backend, torch.device(device), log=rank == 0)  # once
        tune_for(model, spec.block_size, log=rank == 0, kv_dtype=kv_storage_dtype(spec.kv_dtype, dtype))
        if spec.lora is not None:  # the adapters' pool, this rank's shard of each (before the free memory is read)
            model.lora = LoRASlots(model, spec.lora.max_loaded, spec.lora.max_rank)
        config = model.config
        conn.send(Memory(available_memory_bytes(device)))
        allocate = pickle.loads(conn.recv_bytes())
        if not isinstance(allocate, Allocate):
            raise ValueError(f"expected the KV cache's size, got {allocate!r}")
        kv_spec = KVCacheSpec(len(shard.layers), allocate.num_blocks, spec.block_size, len(shard.kv_heads),
                              config.head_dim, kv_storage_dtype(spec.kv_dtype, dtype))
        kv_cache = PagedKVCache(kv_spec, device, store_memory_of(spec.kv_agent, device))
        agent = spec.kv_agent(rank, layout, kv_cache) if spec.kv_agent is not None else None
        samples = rank == layout.sampler_rank
        grammars = None
        if samples:
            from tandem.engine.decoding.grammar import GrammarBackend

            grammars = GrammarBackend(tokenizer, config.vocab_size)
        tiers = None
        if spec.kv_tiers is not None:
            from tandem.engine.kv.tier_store import TierStore

            tiers = TierStore(kv_cache, spec.kv_tiers.host_slots, spec.kv_tiers.rank_folder(rank))
        runner = ModelRunner(model, kv_cache, comm=comm, samples=samples, micro_batches=spec.micro_batches,
                             layer_observer=agent, grammars=grammars, tiers=tiers)
        settle()  # this process serves until Stop: no collection scans what it built (engine/heap.py)
        conn.send(Ready(RankPlacement(rank, os.getpid(), str(device), os.environ.get("CUDA_VISIBLE_DEVICES"),
                                      model.attention.choice.summary(), current_cpus(),
                                      decode_step_summary(model, True, None))))  # eager: spans processes
        while True:
            message = pickle.loads(conn.recv_bytes())
            if isinstance(message, Step):
                output = runner.execute_step(message.schedule, message.prev_tokens)
                if runner.samples or message.schedule.tier_ops.reports:  # every rank's disk failures count
                    conn.send(StepResult(output))
            elif isinstance(message, GetStats):
                data = runner.kv_cache.data
                conn.send(RankStats(rank, model.weight_bytes(), data.numel() * data.element_size(), tuple(data.shape),
                                    runner.times.steps, runner.times.forward, runner.times.num_steps,
                                    dict(comm.seconds), model.expert_load()))
            elif isinstance(message, AgentCall):
                try:  # the agent's own errors (bad descriptor, ...) go back to the caller; the rank lives on
                    conn.send(AgentAnswer(message.fn(agent, *message.args)))
                except Exception as e:
                    conn.send(AgentAnswer(e, raised=True))
            elif isinstance(message, Stop):
                if agent is not None:
                    agent.close()
                if tiers is not None:
                    tiers.close()
                comm.close()
                return
            else:
                raise ValueError(f"unknown message {message!r}")
    except (EOFError, KeyboardInterrupt):
        return  # the driver went away: nothing to report to
    except BaseException as e:
        try:
            where = f"rank {rank}"
            conn.send(RankError(f"{where}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except (OSError, EOFError):
            pass
