"""Every rank of a replica gets its own GPU from Ray, on a CPU machine: a simulated two-node Ray cluster whose
nodes advertise fake GPUs (num_gpus=4 each) runs a manifest whose ranks ask for one GPU each with `device: cpu`
forced. Each rank reports, from inside its own process, the CUDA_VISIBLE_DEVICES it was started with; those are
Ray's assignments, handed out by the replica actor that holds its placement group's GPUs."""

from __future__ import annotations

from collections import defaultdict

from tandem.cluster.manifest import EngineSettings, Pool, Pools, Resources
from tandem.engine.loader.synthetic import write_synthetic_model
from tandem.router.client import TandemClient
from tests.cluster.ray_cluster import manifest_for_test, running, simulated_cluster

GPUS_PER_NODE = 4


def test_each_rank_sees_only_the_gpu_ray_gave_it(tmp_path):
    folder = write_synthetic_model("tiny-moe", tmp_path / "tiny-moe")
    nodes = {name: dict(num_cpus=2, num_gpus=GPUS_PER_NODE) for name in ("gpu-node-a", "gpu-node-b")}
    # Three tp=2 replicas of one GPU per rank: 6 GPUs, more than one node has, so both nodes take replicas.
    decode = Pool(parallelism={"tp": 2}, resources=Resources(cpus=0.5, gpus=1), replicas={"min": 3, "max": 3},
                  engine=EngineSettings(device="cpu", kv_cache_bytes=8 << 20, max_model_len=256))
    manifest = manifest_for_test("local-colocated.yaml", model=str(folder), pools=Pools(decode=decode))
    with simulated_cluster(nodes) as (_, node_ids), running(manifest) as cluster:
        replicas = cluster.status()["replicas"]
        assert len(replicas) == 3
        taken = defaultdict(list)  # node id -> every GPU id its replicas' ranks see
        for replica in replicas:
            assert replica["node_id"] in node_ids.values()
            assert replica["device"] == "cpu float32"  # forced: the fake GPUs are only Ray's bookkeeping
            ranks = replica["rank_placements"]
            assert [r["rank"] for r in ranks] == [0, 1]
            assert len({r["pid"] for r in ranks}) == 2  # each rank is its own process
            assert {r["attention"] for r in ranks} == {"torch (cpu device)"}
            for rank in ranks:
                # exactly one GPU, one of its node's
                assert rank["visible_gpus"] in {str(i) for i in range(GPUS_PER_NODE)}, replica
                taken[replica["node_id"]].append(rank["visible_gpus"])
        assert len(taken) == 2, "the six GPUs were asked for on two four-GPU nodes"
        for node, gpus in taken.items():
            assert len(gpus) == len(set(gpus)), f"node {node}: a GPU is shared between ranks: {sorted(gpus)}"
        with TandemClient(cluster.endpoint, timeout_s=120) as client:
            reply = client.generate(prompt="Hello", max_tokens=4, temperature=0, ignore_eos=True)
            assert len(reply.token_ids[0]) == 4
