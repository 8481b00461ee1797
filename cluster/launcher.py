"""`tandem up / down / status` as functions: connect to Ray (or start a local head), create the cluster's
controller, start it with progress output, find it again later by name, stop it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cluster.controller import Controller, controller_name
from tandem.cluster.manifest import Manifest
from tandem.cluster.replica_plans import resources_needed


class ClusterNotFound(RuntimeError):
    pass


def _ray_cli() -> str:
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def start_local_ray(resources: dict[str, float], out: TextIO) -> None:
    """Starts a Ray head on this machine offering what the manifest needs (logical CPUs at least this machine's
    cores). Raises RuntimeError with Ray's output if it fails."""
    cpus = max(os.cpu_count() or 1, int(-(-resources.get("CPU", 0) // 1)))
    gpus = int(-(-resources.get("GPU", 0) // 1))
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    cmd = [_ray_cli(), "start", "--head", f"--num-cpus={cpus}", "--include-dashboard=false",
           "--disable-usage-stats"]
    if gpus:
        cmd.append(f"--num-gpus={gpus}")
    if custom:
        cmd.append(f"--resources={json.dumps(custom)}")
    print(f"tandem: starting a local Ray head ({cpus} CPUs{', ' + json.dumps(custom) if custom else ''})", file=out)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stdout}{done.stderr}")


def stop_local_ray() -> None:
    subprocess.run([_ray_cli(), "stop"], capture_output=True, text=True)


def connect(address: str | None, namespace: str, *, start_if_missing: dict[str, float] | None = None,
            out: TextIO = sys.stderr) -> bool:
    """Connects this process to Ray. address None: the running local cluster, or (with start_if_missing, the
    resources to offer) a new local head. Returns True if it started one. Raises ClusterNotFound otherwise."""
    if ray.is_initialized():
        return False
    started = False
    try:
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False, logging_level="warning")
    except ConnectionError:
        if address is not None or start_if_missing is None:
            raise ClusterNotFound(f"no Ray cluster at {address or 'this machine'}; start one with `tandem up` "
                                  f"(or `ray start --head`)") from None
        start_local_ray(start_if_missing, out)
        started = True
        ray.init(address="auto", namespace=namespace, log_to_driver=False, logging_level="warning")
    return started


@dataclass
class RunningCluster:
    name: str
    namespace: str
    controller: Any
    endpoint: str | None
    started_ray: bool = False
    http_endpoint: str | None = None

    def status(self) -> dict:
        return ray.get(self.controller.status.remote())

    def replica_handles(self) -> dict:
        return ray.get(self.controller.replica_handles.remote())

    def shutdown(self, stop_ray: bool = True) -> None:
        """Stops every replica and the router, then the controller (and the Ray head tandem started)."""
        try:
            ray.get(self.controller.shutdown.remote(), timeout=120)
        finally:
            ray.kill(self.controller)
        if stop_ray and self.started_ray:
            ray.shutdown()
            stop_local_ray()


def up(manifest: Manifest, *, address: str | None = None, detach: bool = False, out: TextIO = sys.stderr,
       placement_timeout_s: float = 120.0) -> RunningCluster:
    """Starts the manifest's cluster and returns once it serves. Raises RuntimeError (nothing left running)."""
    namespace = manifest.ray.namespace
    started = connect(address or manifest.ray.address, namespace, start_if_missing=resources_needed(manifest), out=out)
    name = controller_name(manifest.name)
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise RuntimeError(f"a cluster named {manifest.name!r} is already running; `tandem down` it first")
    # The controller and the router run on this node: the router's listen address (e.g. 127.0.0.1:50051) is an
    # address of the machine `tandem up` runs on.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    controller = ray.remote(Controller).options(
        name=name, namespace=namespace, num_cpus=0, lifetime="detached" if detach else None, max_concurrency=100,
        scheduling_strategy=here,
    ).remote(manifest, placement_timeout_s=placement_timeout_s, started_ray=started)
    cluster = RunningCluster(manifest.name, namespace, controller, None, started)
    pending = controller.start.remote()
    shown = 0
    try:
        while True:
            ready, _ = ray.wait([pending], timeout=0.5)
            lines = ray.get(controller.log.remote(shown))
            for line in lines:
                print(f"tandem: {line}", file=out, flush=True)
            shown += len(lines)
            if ready:
                break
        endpoints = ray.get(pending)
        cluster.endpoint, cluster.http_endpoint = endpoints["grpc"], endpoints["http"]
    except ray.exceptions.RayTaskError as e:  # start() already stopped what it had started
        cluster.shutdown()
        cause = getattr(e, "cause", None)
        raise RuntimeError(str(cause) if cause is not None else str(e)) from None
    except KeyboardInterrupt:
        print("\ntandem: interrupted while starting; stopping what was started", file=out, flush=True)
        cluster.shutdown()
        raise
    return cluster


def find(name: str = "tandem", *, address: str | None = None, namespace: str = "tandem") -> RunningCluster:
    """The running cluster called name. Raises ClusterNotFound."""
    connect(address, namespace)
    try:
        controller = ray.get_actor(controller_name(name), namespace=namespace)
    except ValueError:
        raise ClusterNotFound(f"no tandem cluster named {name!r} is running on this Ray cluster") from None
    info = ray.get(controller.info.remote())
    return RunningCluster(name, namespace, controller, info["endpoint"], info["started_ray"], info["http_endpoint"])


def serve_until_stopped(cluster: RunningCluster, out: TextIO = sys.stderr) -> None:
    """Blocks until Ctrl-C (then stops the cluster) or until `tandem down` stopped it from elsewhere."""
    try:
        while True:
            time.sleep(1.0)
            try:
                state = ray.get(cluster.controller.info.remote(), timeout=10)["state"]
            except (ray.exceptions.RayError, TimeoutError):
                state = "gone"
            if state in ("stopped", "gone"):
                print("tandem: the cluster was stopped", file=out)
                if cluster.started_ray:
                    ray.shutdown()
                    stop_local_ray()
                return
    except KeyboardInterrupt:
        print("\ntandem: stopping", file=out, flush=True)
        cluster.shutdown()
