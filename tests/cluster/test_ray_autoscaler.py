"""Ray's own autoscaler, run: deploy/ray/fake-multinode.yaml (Ray's fake multi-node provider, whose "nodes" are Ray
nodes on this machine) with deploy/manifests/fake-multinode.yaml on it.

Fast (CI): the config passes Ray's schema and the checks the head's monitor runs on it, Ray's provider builds from
it and knows its head, its node types are those of the GPU configs with no GPUs, and the manifest's replicas fit
them (tests/deploy/ray_config_checks.py, as for the `ray up` configs). A ReplicaSet on a real Ray takes a replica
that goes out of what it asked Ray's autoscaler for (a request stands until the next one, and Ray keeps the nodes
it names).

Slow (the real run, about a minute on two cores): `RAY_FAKE_CLUSTER=1 ray start --head
--autoscaling-config=...` on loopback, free ports and a temporary dir; a foreground `tandem up` on that head asks
for one prefill and one decode replica; Ray's autoscaler launches a prefill_gpu and a decode_gpu node for them; a
request is served through the gRPC client; `tandem scale prefill 0` drains the prefill replica and Ray removes its
node once idle, while the decode replica serves on (it prefills itself); stopping `tandem up` (SIGTERM) stops the
cluster, after which Ray removes the decode node too; stopping the head leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import yaml

from tandem.cluster import launcher, local_ray
from tandem.cluster.manifest_checks import validate_file
from tandem.cluster.replica_plans import replica_plan
from tandem.cluster.replica_set import ASK_RAY_AFTER_S, ReplicaSet
from tandem.router.client import TandemClient
from tests.cluster.ray_cluster import simulated_cluster
from tests.deploy.ray_config_checks import (
    FAKE_MULTINODE, RAY_BUILTIN_RESOURCES, ROOT, fit_report, load, node_types, schema_errors)
from tests.ports import free_port

MANIFEST = ROOT / "deploy" / "manifests" / "fake-multinode.yaml"
GPU_CONFIGS = [ROOT / "deploy" / "ray" / name for name in ("aws-gpu.yaml", "gcp-gpu.yaml")]
TANDEM = [sys.executable, "-m", "tandem.cluster.cli"]
RAY = str(Path(sys.executable).parent / "ray")
POOL_RESOURCE = {"prefill": "tandem_prefill", "decode": "tandem_decode"}


# ---- fast: the files ------------------------------------------------------------------------------------------


def test_the_config_passes_rays_schema_and_the_checks_its_monitor_runs(monkeypatch):
    """No `ray up` here: the head's monitor reads the file as it is (no defaults merged), runs validate_config on
    it, and builds the provider, which names its head node type itself."""
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
    from ray.autoscaler._private.providers import _get_node_provider
    from ray.autoscaler._private.util import validate_config
    from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    config = load(FAKE_MULTINODE)
    assert schema_errors(config) == []
    validate_config(config)
    assert config["provider"]["type"] == "fake_multinode" and config["provider"]["use_node_id_as_ip"] is True
    assert 0 < config["idle_timeout_minutes"] <= 0.25  # an idle node goes within seconds

    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")  # what the provider insists on (the head's `ray start` has it)
    provider = _get_node_provider(config["provider"], config["cluster_name"], use_cache=False)
    assert isinstance(provider, FakeMultiNodeProvider)
    [head] = provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD})
    assert provider.node_tags(head)[TAG_RAY_USER_NODE_TYPE] == config["head_node_type"]


@pytest.mark.parametrize("gpu_config", GPU_CONFIGS, ids=[p.name for p in GPU_CONFIGS])
def test_its_node_types_are_the_gpu_configs_with_no_gpus(gpu_config):
    fake, gpu = load(FAKE_MULTINODE), load(gpu_config)
    fake_workers = {t.name: t for t in node_types(fake) if not t.is_head}
    gpu_workers = {t.name: t for t in node_types(gpu) if not t.is_head}
    assert fake_workers.keys() == gpu_workers.keys() == {"prefill_gpu", "decode_gpu"}
    for name, t in fake_workers.items():
        custom = set(t.offers) - RAY_BUILTIN_RESOURCES
        assert custom == set(gpu_workers[name].offers) - RAY_BUILTIN_RESOURCES and len(custom) == 1, name
        assert t.offers["GPU"] == 0 and fake["available_node_types"][name]["min_workers"] == 0, name
    [head] = [t for t in node_types(fake) if t.is_head]
    assert head.offers.get("GPU") == 0 and not set(head.offers) - RAY_BUILTIN_RESOURCES


def test_the_manifest_fits_the_node_types_on_cpus():
    manifest = validate_file(MANIFEST, check_ports=False)
    report = fit_report(load(FAKE_MULTINODE), manifest)
    assert report.problems == [] and report.notes == []
    for name, pool in manifest.pool_items():
        assert pool.resources.gpus == 0 and set(pool.resources.custom) == {POOL_RESOURCE[name]}
        spec = replica_plan(manifest, name, 0).spec
        assert spec.device == "cpu" and spec.threads == 1 and spec.parallel.world_size == 1, name
    assert manifest.pools.decode.engine.compile is False  # no minute-long compile per replica on two cores


# ---- fast: what Ray's autoscaler is asked for ---------------------------------------------------------------------


def requested() -> list[dict[str, float]]:
    """What Ray's autoscaler holds as the standing request_resources (the key its monitor reads)."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    stored = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(stored) if stored else []


async def eventually(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


def test_a_replica_that_goes_is_taken_out_of_the_request_to_rays_autoscaler():
    """On a Ray offering neither pool's resource (a cloud cluster before its autoscaler added nodes), replicas wait
    in placement and Ray's autoscaler is asked for their bundles; one drained before it was placed leaves the
    request, and stopping the rest withdraws it (else Ray would keep their nodes for good)."""
    manifest = validate_file(MANIFEST, check_ports=False)
    prefill = {"CPU": 1.0, "tandem_prefill": 1.0}
    decode = {"CPU": 1.0, "tandem_decode": 1.0}
    # Not a bare ray.init(): on Ray 2.60 a new local cluster turns on token auth and writes ~/.ray/auth_token, after
    # which every `ray start --head` on this machine turns it on too (and tandem's drivers, which connect by
    # address, are refused).
    with simulated_cluster({"cpu": dict(num_cpus=1)}):
        async def scenario() -> None:
            replicas = ReplicaSet(manifest, bytes(32), lambda line: None)
            replicas.start("prefill", 1)
            replicas.start("decode", 1)
            await eventually(lambda: len(replicas.asked_bundles) == 2, ASK_RAY_AFTER_S + 5, "no request to Ray")
            assert requested() == [prefill, decode]
            assert replicas.counts("prefill").starting == 1  # still placing: nothing offers tandem_prefill
            replicas.drain("prefill", 1)
            await eventually(lambda: replicas.asked_bundles == [decode], 10, "the drained replica still asked for")
            assert requested() == [decode]
            await replicas.shutdown()
            assert replicas.asked_bundles == [] and requested() == []

        asyncio.run(scenario())


# ---- slow: the real run ---------------------------------------------------------------------------------------


def wait_until(check, timeout_s: float, what, every_s: float = 1.0):
    """Polls check() until it returns something true, which it returns; fails after timeout_s naming what (a
    string, or a function that says it then)."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what() if callable(what) else what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return result


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


def offering(resource: str) -> list[dict]:
    return [n for n in alive_nodes() if n["Resources"].get(resource)]


def monitor_lines(temp_dir: Path, *words: str) -> list[str]:
    """The lines of the head's autoscaler log (Ray's monitor) that hold every one of words."""
    text = (temp_dir / "session_latest" / "logs" / "monitor.log").read_text()
    return [line for line in text.splitlines() if all(word in line for word in words)]


def processes_of(head: local_ray.LocalHead, temp_dir: Path) -> list[str]:
    """Every live process of the head's session, or whose command line names its temp dir: 'pid command'."""
    found = set(local_ray.processes(head))
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if str(temp_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:
            continue
    described = []
    for pid in sorted(found):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                described.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:160]!r}")
        except OSError:
            continue
    return described


def fake_cluster_env() -> dict[str, str]:
    """The environment of the head and of `tandem up`: Ray's token auth off, whatever ~/.ray/auth_token says (Ray
    2.60's `ray start --head` turns it on when that file exists, and a driver that connects by address does not
    follow), and no RAY_ADDRESS of another cluster."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}


def start_fake_head(temp_dir: Path) -> tuple[local_ray.LocalHead, float]:
    """`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...` on loopback with free ports, in a session
    of its own (the nodes the provider launches are its processes' children, in that session too). Returns the
    head and how long it took."""
    port = free_port()
    config = load(FAKE_MULTINODE)
    config["provider"]["gcs_address"] = f"127.0.0.1:{port}"  # where the launched nodes find the GCS
    config_path = temp_dir / "ray-cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    head = config["available_node_types"][config["head_node_type"]]["resources"]
    command = [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
               f"--num-cpus={head['CPU']}", f"--num-gpus={head['GPU']}", f"--temp-dir={temp_dir}",
               f"--autoscaling-config={config_path}", "--include-dashboard=false", "--disable-usage-stats",
               f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
               "--dashboard-agent-listen-port=0"]
    env = fake_cluster_env() | {"RAY_FAKE_CLUSTER": "1", local_ray.SINGLE_NODE_ENV: "0"}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    head_ = local_ray.LocalHead(f"127.0.0.1:{port}", process.pid, 0, "")  # its session: the `ray start` pid
    try:
        output, _ = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        process.kill()
        local_ray.stop(head_, grace_s=0)
        pytest.fail("`ray start --head` did not return within 180 s")
    if process.returncode != 0:
        local_ray.stop(head_, grace_s=0)
        pytest.fail(f"`{' '.join(command)}` failed:\n{output}")
    return head_, time.monotonic() - started


@pytest.mark.slow
def test_rays_autoscaler_adds_and_removes_nodes_for_tandems_pools(monkeypatch):
    import ray._private.ray_constants as ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)  # connect() sets it
    temp_dir = Path(tempfile.mkdtemp(prefix="tandem-fake-", dir="/tmp"))  # short: Ray's socket paths live under it
    manifest = temp_dir / "manifest.yaml"
    manifest.write_text(MANIFEST.read_text().replace("127.0.0.1:50051", "127.0.0.1:0")
                        .replace("127.0.0.1:8000", "127.0.0.1:0"))
    log = temp_dir / "tandem-up.log"
    timings: dict[str, float] = {}
    head, up = None, None
    try:
        head, timings["ray start --head"] = start_fake_head(temp_dir)
        address = head.gcs_address
        started = time.monotonic()
        with log.open("w") as err:
            up = subprocess.Popen([*TANDEM, "up", str(manifest), "--address", address, "--placement-timeout",
                                   "300"], stdout=subprocess.DEVNULL, stderr=err, env=fake_cluster_env())

        def serving() -> bool:
            assert up.poll() is None, f"`tandem up` exited ({up.returncode}):\n{log.read_text()}"
            return "is serving" in log.read_text()

        wait_until(serving, 420, lambda: f"`tandem up` serving (its log so far:\n{log.read_text()})")
        timings["tandem up to serving"] = time.monotonic() - started
        cluster = launcher.find(address=address)

        # Ray's autoscaler launched one node per replica, of the pool's node type; the head offers neither.
        status = cluster.status()
        nodes = {pool: offering(resource) for pool, resource in POOL_RESOURCE.items()}
        assert [len(nodes["prefill"]), len(nodes["decode"])] == [1, 1], alive_nodes()
        assert len(alive_nodes()) == 3
        where = {r["name"]: r["node_id"] for r in status["replicas"]}
        assert where == {"prefill-0": nodes["prefill"][0]["NodeID"], "decode-0": nodes["decode"][0]["NodeID"]}
        assert not nodes["prefill"][0]["Resources"].get("GPU") and "tandem_decode" not in nodes["prefill"][0][
            "Resources"]
        for node_type in ("prefill_gpu", "decode_gpu"):
            assert len(monitor_lines(temp_dir, f"Adding 1 node(s) of type {node_type}.")) == 1, node_type

        with TandemClient(cluster.endpoint, timeout_s=120) as client:
            reply = client.generate(chat=[{"role": "user", "content": "What is the capital of France?"}],
                                    max_tokens=12, temperature=0)
        assert reply.text.strip() and reply.usage.completion_tokens > 0
        assert (reply.prefill_replica, reply.decode_replica) == ("prefill-0", "decode-0")

        # The prefill pool scales to zero: its replica drains, its bundle leaves the request to Ray's autoscaler,
        # and Ray removes the node it leaves idle. The decode node stays, and the decode replica serves alone.
        prefill_node = nodes["prefill"][0]["NodeID"]
        started = time.monotonic()
        assert "pinned at 0" in cluster.scale("prefill", 0)
        wait_until(lambda: cluster.status()["pools"]["prefill"]["ready"] + cluster.status()["pools"]["prefill"][
            "draining"] == 0, 120, "the prefill replica drained and stopped")
        assert all("tandem_prefill" not in bundle for bundle in cluster.status()["resource_request"]["bundles"])
        wait_until(lambda: not any(n["NodeID"] == prefill_node for n in alive_nodes()), 120,
                   "Ray's autoscaler removing the idle prefill_gpu node")
        timings["scale prefill 0 to its node removed"] = time.monotonic() - started
        assert monitor_lines(temp_dir, f"Terminating the node with id {prefill_node}", "(idle)")
        assert offering("tandem_prefill") == [] and len(offering("tandem_decode")) == 1
        with TandemClient(cluster.endpoint, timeout_s=120) as client:
            reply = client.generate(chat=[{"role": "user", "content": "Name three colors."}], max_tokens=8,
                                    temperature=0)
        assert reply.text.strip() and reply.decode_replica == "decode-0" and not reply.prefill_replica
        asks = cluster.status()["resource_request"]["asks"]

        # `tandem up` stops as on Ctrl-C (SIGTERM): the cluster goes, the head it did not start stays, and with
        # nothing asked for any more Ray removes the decode node too.
        started = time.monotonic()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, log.read_text()
        assert "tandem: stopping" in log.read_text()
        wait_until(lambda: len(alive_nodes()) == 1, 120, "Ray's autoscaler removing the idle decode_gpu node")
        timings["tandem stopped to its last node removed"] = time.monotonic() - started
        assert monitor_lines(temp_dir, f"Terminating the node with id {nodes['decode'][0]['NodeID']}", "(idle)")
        assert requested() == []
        ray.shutdown()
        print(f"\nfake multi-node run: {json.dumps({k: round(v, 1) for k, v in timings.items()})}; "
              f"{asks} request(s) to Ray's autoscaler")
    finally:
        ray.shutdown()
        if up is not None and up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        if head is not None:
            local_ray.stop(head, grace_s=10)  # `ray stop`'s order, for this head's session only
            wait_until(lambda: not processes_of(head, temp_dir), 20,
                       lambda: f"every process of the fake cluster gone (left: {processes_of(head, temp_dir)})",
                       every_s=0.5)
        subprocess.run(["rm", "-rf", str(temp_dir)], check=False)
