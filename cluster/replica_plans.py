"""The manifest turned into what each replica actor is built from: ReplicaSpec (engine) and TransferConfig (KV
transfer), plus the Ray placement each replica asks for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tandem.cluster.manifest import Manifest, Pool
from tandem.engine.engine_config import SchedulingConfig
from tandem.engine.parallel.layout import ParallelConfig
from tandem.kv_transfer.config import DEFAULT_UCX_ENV, TransferConfig
from tandem.replica.spec import ReplicaSpec


@dataclass(frozen=True)
class ReplicaPlan:
    name: str  # "prefill-0", "decode-1", ...
    pool: str
    spec: ReplicaSpec
    bundles: tuple[dict[str, float], ...]  # what each rank asks Ray for

    @property
    def bundle(self) -> dict[str, float]:
        """The replica's one placement-group bundle: every rank's resources together, so that its ranks land on
        one node and the replica actor holds all their GPUs (it hands each rank its share, engine/hardware/device.py
        split_gpu_ids)."""
        return _summed(self.bundles)


def absolute_model(manifest: Manifest) -> str | None:
    """The model path as every node should read it (absolute), None for the embedded model."""
    path = manifest.model_path
    return None if path is None else str(Path(path).expanduser().resolve())


def replica_spec(manifest: Manifest, pool: Pool) -> ReplicaSpec:
    e = pool.engine
    # The compiled step serves decode batches: a prefill pool's replicas have none to run, so by default they skip
    # compiling it (and start sooner).
    decodes = not (manifest.mode == "disaggregated" and pool is manifest.pools.prefill)
    compile_step = False if e.compile is None and pool is manifest.pools.prefill else e.compile
    speculative = e.speculative.config() if e.speculative and decodes else None
    if speculative is not None and speculative.draft != "self":  # a draft model's path, as every node reads it
        speculative = dataclasses.replace(speculative, draft=str(Path(speculative.draft).expanduser().resolve()))
    lora = manifest.lora
    engine = e.config(compile=compile_step, speculative=speculative, lora=lora.config() if lora else None,
                      scheduling=scheduling_config(manifest, pool))
    adapters = tuple((name, str(Path(path).expanduser().resolve()))  # as every node reads them
                     for name, path in (lora.adapters if lora else {}).items())
    p = pool.parallelism
    threads = max(1, round(pool.resources.cpus * p.world_size))
    return ReplicaSpec(model=absolute_model(manifest), device=e.device, dtype=pool.dtype if e.weights != "dense"
                       else e.dtype, weights=e.weights, load_format=e.load_format, engine=engine,
                       parallel=ParallelConfig(tp=p.tp, pp=p.pp, ep=p.ep), threads=threads,
                       cpu_affinity=pool.cpu_affinity, lora_adapters=adapters)


def scheduling_config(manifest: Manifest, pool: Pool) -> SchedulingConfig:
    """The pool's scheduler section with the tenants' weights (auth.tenants.<name>.weight, default_tenant's)."""
    auth = manifest.auth
    weights = tuple((tenant, limits.weight) for tenant, limits in auth.tenants.items())
    return pool.scheduler.config(weights, auth.default_tenant.weight)


def replica_plan(manifest: Manifest, pool_name: str, index: int) -> ReplicaPlan:
    """The index-th replica of a pool (named "<pool>-<index>"; a replica started later, by the autoscaler or to
    replace a dead one, gets the next index)."""
    pool = manifest.pool(pool_name)
    bundles = (pool.resources.bundle(),) * pool.parallelism.world_size
    return ReplicaPlan(f"{pool_name}-{index}", pool_name, replica_spec(manifest, pool), bundles)


def replica_plans(manifest: Manifest, count: dict[str, int] | None = None) -> list[ReplicaPlan]:
    """The replicas `tandem up` starts: each pool's initial count (or count[pool])."""
    return [replica_plan(manifest, name, i) for name, pool in manifest.pool_items()
            for i in range((count or {}).get(name, pool.replicas.start))]


def transfer_config(manifest: Manifest, secret: bytes) -> TransferConfig:
    """host "" means: each replica's node address, filled in on the node (TransferConfig.on_host). secret: the
    cluster's transfer secret (the controller makes one per cluster): every replica must get the same."""
    t = manifest.transport
    return TransferConfig(host=t.host or "", layer_group=t.layer_group, max_message_bytes=t.max_message_bytes,
                          staging_bytes=t.staging_bytes, lease_s=t.lease_s, shared_memory=t.shared_memory,
                          ucx_env=DEFAULT_UCX_ENV | t.ucx_env, secret=secret)


def resources_needed(manifest: Manifest) -> dict[str, float]:
    """Ray resources the initial replicas need in all (for starting a local Ray that can hold them)."""
    return _summed([plan.bundle for plan in replica_plans(manifest)])


def _summed(bundles) -> dict[str, float]:
    """Ray resources added up by name."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total
