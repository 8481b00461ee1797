"""The shipped manifests as the cluster benchmarks run them."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

from tandem.cluster.manifest_yaml import load_manifest

MANIFESTS = Path(__file__).resolve().parents[1] / "deploy" / "manifests"


def manifest_to_measure(name: str):
    """deploy/manifests/<name> as measured (measured)."""
    return measured(load_manifest(MANIFESTS / name))


def measured(manifest):
    """The manifest with each pool's `compile: background` made a compilation before the replica serves (the
    engine's default, TANDEM_COMPILE): a benchmark times the replicas as they serve for good, not while a thread
    compiles their step beside them (make run's manifests compile their decode pools in the background)."""
    pools = {}
    for role in ("prefill", "decode"):
        pool = getattr(manifest.pools, role)
        if pool is not None and pool.engine.compile == "background":
            pools[role] = pool.model_copy(update={"engine": pool.engine.model_copy(update={"compile": None})})
    return manifest.model_copy(update={"pools": manifest.pools.model_copy(update=pools)}) if pools else manifest


@contextmanager
def local_cluster(manifest, why: str = "each deployment gets the same cores"):
    """The manifest as a cluster on a local Ray head started for it (gRPC on a free loopback port), stopped with
    its head on leaving. Raises RuntimeError when a Ray cluster was already running (why: what that would spoil)."""
    import ray

    from tandem.cluster import launcher

    manifest = manifest.model_copy(update={"listen": manifest.listen.model_copy(update={"grpc": "127.0.0.1:0"})})
    cluster = launcher.up(manifest, out=sys.stderr)
    try:
        if not cluster.started_ray:
            raise RuntimeError(f"a Ray cluster was already running; stop it so that {why}")
        yield cluster
    finally:
        cluster.shutdown()
        ray.shutdown()
