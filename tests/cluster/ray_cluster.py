"""A multi-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster): a head that offers no CPUs
(nothing of ours lands there but the control actors) and separate nodes offering the `prefill` and `decode`
resources the manifests ask for. Each node runs its own raylet, so placement across nodes, node-local ports and
cross-node UCX addresses are exercised. One cluster at a time per test process."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from tandem.cluster import launcher
from tandem.cluster.manifest import Manifest
from tandem.cluster.manifest_yaml import load_manifest

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "manifests"
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Who wrote Hamlet?", "Give me a synonym for happy.",
             "Describe a cat in one sentence.", "What is the boiling point of water?"]


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def manifest_for_test(name: str, **updates) -> Manifest:
    """A manifest of deploy/manifests with its ports made free (port 0) and fields replaced."""
    manifest = load_manifest(MANIFESTS / name)
    listen = {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0" if manifest.listen.http else None}
    return manifest.model_copy(update={"listen": manifest.listen.model_copy(update=listen)} | updates)


@contextlib.contextmanager
def simulated_cluster(nodes: dict[str, dict] | None = None):
    """Yields (cluster, node ids by role). nodes: role -> Cluster.add_node kwargs."""
    nodes = nodes or {"prefill": dict(num_cpus=1, resources={"prefill": 4}),
                      "decode": dict(num_cpus=1, resources={"decode": 4})}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        ids = {role: cluster.add_node(**kwargs).node_id for role, kwargs in nodes.items()}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="tandem", log_to_driver=False)
        yield cluster, ids
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def running(manifest: Manifest):
    """Starts manifest's cluster on the connected Ray cluster; stops it on exit."""
    cluster = launcher.up(manifest)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def wait_idle(cluster: launcher.RunningCluster, timeout_s: float = 20.0) -> list[dict]:
    """Polls status until no replica holds a KV block, runs or waits; returns the replicas' status. Raises
    AssertionError naming what is still held after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = cluster.status()["replicas"]
        busy = [r for r in replicas
                if any(r.get(k) for k in ("kv_blocks_in_use", "running", "waiting", "waiting_for_kv"))]
        if not busy:
            return replicas
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas still hold requests or blocks: {busy}")
        time.sleep(0.1)


def check_integrity(cluster: launcher.RunningCluster) -> None:
    """Every replica's block bookkeeping and KV agents check themselves (raises on a problem)."""
    handles = cluster.replica_handles()
    ray.get([h.check_integrity.remote() for h in handles.values()])


def one_process_lora(embedded, adapters: dict[str, str], asks: list[tuple[str, str | None]],
                     max_tokens: int) -> list[list[int]]:
    """Greedy tokens of (question, LoRA adapter or None) pairs from one engine in this process serving `adapters`
    (name -> PEFT folder): what a cluster serving them must answer."""
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig, LoRAConfig
    from tandem.engine.sampling_params import SamplingParams

    with LLMEngine(embedded, EngineConfig(num_kv_blocks=256, lora=LoRAConfig(max_rank=16, max_loaded=3))) as engine:
        for name, path in adapters.items():
            engine.load_lora(name, path)
        for i, (question, adapter) in enumerate(asks):
            engine.add_request(f"r{i}", embedded.tokenizer.encode_chat(chat(question)),
                               SamplingParams(max_tokens=max_tokens, temperature=0, lora=adapter))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.token_ids)
    return [done[f"r{i}"] for i in range(len(asks))]
