"""The manifest the Helm chart renders for its CPU demo (ci/cpu-demo-values.yaml) serves: on a Ray cluster
simulated on this machine whose nodes offer what the rendered RayCluster's worker groups offer (CPUs from the
containers' limits, the tandem_<pool> resources from rayStartParams, both read from the rendered objects), tandem
places each replica on the node group that holds its pool, and a chat request through the router equals a
single-process run. The control pod's own part (`tandem up` as a driver on the pod's Ray node, so that the router
runs there) is Ray's ordinary driver placement and is not simulated: the test process is the driver, on the
head."""

from __future__ import annotations

import yaml

from tandem.cluster.manifest_checks import validate_file
from tandem.engine.core.generator import Generator
from tandem.engine.sampling_params import SamplingParams
from tandem.router.client import TandemClient
from tests.cluster.ray_cluster import chat, running, simulated_cluster, wait_idle
from tests.deploy.helm_render import manifest_text, one, ray_offers, render, values_of

QUESTION = "Name three colors."
MAX_TOKENS = 16


def node_args(group: dict) -> dict:
    """Cluster.add_node arguments for one pod of a rendered worker group."""
    offers = ray_offers(group)
    cpus, gpus = offers.pop("CPU"), offers.pop("GPU")
    assert gpus == 0, "the CPU demo asks for no GPU"
    return {"num_cpus": int(cpus), "resources": offers}


def test_the_cpu_demo_manifest_serves_on_the_nodes_the_chart_renders(tmp_path, embedded, embedded_shape_once):
    objects = render(values_of("cpu-demo"))
    groups = {g["groupName"]: g for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"control", "cpu"}
    manifest = yaml.safe_load(manifest_text(objects))
    assert manifest["listen"] == {"grpc": "0.0.0.0:50051", "http": "0.0.0.0:8000"}
    manifest["listen"] = {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"}  # this machine's ports are not a pod's
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest))
    manifest = validate_file(path, check_ports=False)

    with simulated_cluster({name: node_args(group) for name, group in groups.items()}) as (_, node_ids):
        with running(manifest) as cluster:
            placed = {r["name"]: r["node_id"] for r in cluster.status()["replicas"]}
            assert placed == {"prefill-0": node_ids["cpu"], "decode-0": node_ids["cpu"]}
            with TandemClient(cluster.endpoint, timeout_s=120) as client:
                got = client.generate(chat=chat(QUESTION), max_tokens=MAX_TOKENS, temperature=0)
            wait_idle(cluster)
    with Generator(embedded) as reference:
        want = reference.generate(embedded.tokenizer.encode_chat(chat(QUESTION)),
                                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert got.token_ids[0] == want.token_ids
    assert got.text == want.text
    assert (got.prefill_replica, got.decode_replica, got.prefill_route) == ("prefill-0", "decode-0", "prefill_pool")
