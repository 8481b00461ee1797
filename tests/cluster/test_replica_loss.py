"""A decode replica that dies (its actor killed, ranks and all) while streaming: the client gets UNAVAILABLE
naming it, `tandem status` reports it dead, the router stops routing to it, and the other decode replica keeps
serving with nothing left held on the prefill replica."""

from __future__ import annotations

import grpc
import pytest
import ray

from tandem.router.client import TandemClient
from tests.cluster.ray_cluster import manifest_for_test, running, simulated_cluster


def two_decode_replicas():
    manifest = manifest_for_test("local.yaml")
    decode = manifest.pools.decode
    replicas = decode.replicas.model_copy(update={"max": 2, "initial": 2})
    pools = manifest.pools.model_copy(update={"decode": decode.model_copy(update={"replicas": replicas})})
    return manifest.model_copy(update={"pools": pools})


def test_a_decode_replica_dies_mid_stream():
    nodes = {"prefill": dict(num_cpus=1, resources={"prefill": 4}),
             "decode": dict(num_cpus=2, resources={"decode": 4})}
    with simulated_cluster(nodes), running(two_decode_replicas()) as cluster:
        handles = cluster.replica_handles()
        with TandemClient(cluster.endpoint, timeout_s=120) as client:
            stream = client.stream(prompt="Once upon a time", max_tokens=300, temperature=0, ignore_eos=True)
            first = next(stream)
            victim = first.decode_replica
            assert victim in ("decode-0", "decode-1")
            ray.kill(handles[victim])
            with pytest.raises(grpc.RpcError) as failure:
                for _ in stream:
                    pass
            assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
            assert victim in failure.value.details()

            survivor = "decode-1" if victim == "decode-0" else "decode-0"
            for i in range(3):
                result = client.generate(prompt=f"Question {i}: what is the capital of France?", max_tokens=4,
                                         temperature=0)
                assert result.usage.completion_tokens == 4 and result.decode_replica == survivor

        status = cluster.status()
        states = {r["name"]: r["state"] for r in status["replicas"]}
        assert states[victim] == "dead" and states[survivor] == "ready" and states["prefill-0"] == "ready"
        assert status["router"]["replicas_lost"] == [victim]
        live = [r for r in status["replicas"] if r["state"] == "ready"]
        assert all(r["kv_blocks_in_use"] == 0 for r in live)
