"""`tandem up / down / status` as functions: connect to Ray (or start a local head: cluster/local_ray.py), create
the cluster's controller, start it with progress output, find it again later by name, stop it, and with it the
Ray head `tandem up` started, also when that head's GCS no longer answers. A foreground `tandem up` stops the same
way on Ctrl-C, SIGTERM and SIGHUP (stop_on_signals)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cluster import local_ray
from tandem.cluster.controller import Controller, controller_name
from tandem.cluster.manifest import Manifest
from tandem.cluster.replica_plans import resources_needed

STOP_RAY_HINT = ("`ray stop --force` stops it (and every other Ray process on this machine); then run `tandem up` "
                 "again")


class ClusterNotFound(RuntimeError):
    pass


class RayHeadNotAnswering(ClusterNotFound):
    """The Ray head a driver here would connect to did not answer within local_ray.PROBE_TIMEOUT_S. head: the
    local head tandem started at that address (None: not one of tandem's)."""

    def __init__(self, message: str, address: str, head: local_ray.LocalHead | None):
        super().__init__(message)
        self.address = address
        self.head = head


def _tell(out: TextIO, text: str) -> None:
    """Prints a progress line; a terminal that went away (SIGHUP) must not stop the shutdown that follows."""
    try:
        print(text, file=out, flush=True)
    except OSError:
        pass


def stop_on_signals() -> None:
    """Makes SIGTERM (`timeout`, service managers, kill) and SIGHUP (a closed terminal) stop this process as
    Ctrl-C does, with KeyboardInterrupt, so that `tandem up` stops its cluster and the Ray head it started. Once
    one arrived, the next are ignored: they must not cut that shutdown short (Ctrl-C still can). Main thread only."""

    def interrupt(signum, frame):
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def connect(address: str | None, namespace: str, *, start_if_missing: dict[str, float] | None = None,
            host: str = "127.0.0.1", out: TextIO = sys.stderr) -> bool:
    """Connects this process to Ray. address None: the local cluster (RAY_ADDRESS, or the head Ray's address
    file names), or with start_if_missing (the resources to offer) a new local head listening on host; "auto":
    the local cluster only; HOST:PORT: that one. A head that does not answer within a few seconds is not retried
    forever: with start_if_missing, a local one tandem started is stopped (and a stale address file with no Ray
    process behind it removed) and a fresh head started. Returns True if it started a head. Raises
    ClusterNotFound (RayHeadNotAnswering for a head that does not answer, saying what clears it)."""
    if ray.is_initialized():
        return False
    explicit = address not in (None, "auto") or bool(os.environ.get("RAY_ADDRESS"))
    target = address if address not in (None, "auto") else local_ray.current_address()
    if target is not None:
        local_ray.use_head_token(target)  # a head tandem started: its own token
    if target is not None and "://" not in target and not local_ray.answers(target):  # ray://: Ray Client's own
        _clear_dead_head(target, explicit=explicit, can_start=start_if_missing is not None, out=out)
        target = None
    started = False
    if target is None:
        if address is not None or start_if_missing is None:
            raise ClusterNotFound(f"no Ray cluster at {address or 'this machine'}; start one with `tandem up` "
                                  f"(or `ray start --head`)")
        target, started = local_ray.start(start_if_missing, host, out).gcs_address, True
        local_ray.use_head_token(target)
    keep = signal.getsignal(signal.SIGTERM)
    local_ray.connect_mode(target)
    try:
        ray.init(address=target, namespace=namespace, log_to_driver=False, logging_level="warning")
    except BaseException:
        if started:
            _stop_started_head(target)
        raise
    if callable(keep) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, keep)  # ray.init makes SIGTERM sys.exit; keep the caller's clean stop
    return started


def _clear_dead_head(address: str, *, explicit: bool, can_start: bool, out: TextIO) -> None:
    """Clears the way for a fresh local head where the one at address does not answer, or raises
    RayHeadNotAnswering: for an address given explicitly, without can_start, or for a head tandem did not start
    whose processes still run."""
    head = local_ray.recorded()
    ours = head if head is not None and head.gcs_address == address else None
    late = f"does not answer within {local_ray.PROBE_TIMEOUT_S:g} s"
    if explicit:
        raise RayHeadNotAnswering(f"no Ray cluster answers at {address} ({late})" + (
            "; it is a head tandem started: `tandem down` stops what is left of it" if ours else ""), address, ours)
    where = f"the local Ray head at {address} (named in {local_ray.address_file()})"
    if ours is None and not local_ray.ray_processes_running():  # a stale record: nothing runs
        if not can_start:
            raise RayHeadNotAnswering(f"no Ray cluster runs on this machine ({where} is gone); start one with "
                                      f"`tandem up`", address, None)
        _tell(out, f"tandem: {where} {late} and no Ray process runs here: forgetting that stale address")
        local_ray.forget_address_file()
        return
    if not can_start:
        raise RayHeadNotAnswering(f"{where} {late}; " + ("`tandem down` stops what is left of it" if ours else
                                                         STOP_RAY_HINT), address, ours)
    if ours is None:
        raise RayHeadNotAnswering(f"{where} {late} and was not started by tandem; {STOP_RAY_HINT}", address, None)
    _tell(out, f"tandem: {where} {late}; it is one tandem started: stopping what is left of it")
    local_ray.stop(ours, grace_s=0)


def _stop_started_head(gcs_address: str | None, answering: bool = True) -> None:
    """Disconnects and stops the local head tandem started at gcs_address (None: the one tandem started last).
    A head whose GCS does not answer (answering False, or a probe says so now) is killed first: ray.shutdown()
    waits minutes on a GCS that is there but silent, seconds on one that is gone."""
    head = local_ray.recorded()
    if head is not None and gcs_address is not None and head.gcs_address != gcs_address:
        head = None
    answering = answering and head is not None and local_ray.answers(head.gcs_address)
    if head is not None and not answering:
        local_ray.stop(head, grace_s=0)
    ray.shutdown()
    if head is not None and answering:
        local_ray.stop(head)


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

    def scale(self, pool: str, count: int | None) -> str:
        """Pins pool at count replicas (None: back to the autoscaler); returns what the controller did."""
        return ray.get(self.controller.scale.remote(pool, count))

    def log(self) -> list[str]:
        """The control plane's log lines (start-up progress, scaling decisions, replicas lost and replaced)."""
        return ray.get(self.controller.log.remote())

    def shutdown(self, stop_ray: bool = True, *, drain: bool = False, out: TextIO | None = None) -> None:
        """Stops every replica and the router, then the controller, then (stop_ray) the local Ray head this
        cluster's `tandem up` started: that one also when the controller or Ray's GCS no longer answer. drain:
        the router first drains (router.drain_timeout_s), its progress lines printed to out."""
        gcs = ray.get_runtime_context().gcs_address
        answering = local_ray.answers(gcs)  # if not, the actors went with the GCS, or calls to them would hang
        try:
            if answering:
                try:
                    shown = len(ray.get(self.controller.log.remote(), timeout=10)) if drain else 0
                    pending = self.controller.shutdown.remote(drain)
                    # A drain is bounded by the controller (drain_timeout_s, then a few seconds); a stop by 120 s.
                    deadline = None if drain else time.monotonic() + 120
                    while True:
                        done = ray.wait([pending], timeout=0.5)[0]
                        if drain and out is not None:  # the drain's progress lines, as they come
                            lines = ray.get(self.controller.log.remote(shown), timeout=10)
                            for line in lines:
                                _tell(out, f"tandem: {line}")
                            shown += len(lines)
                        if done:
                            break
                        if deadline is not None and time.monotonic() > deadline:
                            raise TimeoutError("the cluster did not stop within 120 s")
                    ray.get(pending)
                finally:
                    ray.kill(self.controller)
        finally:
            if stop_ray and self.started_ray:
                _stop_started_head(gcs, answering)


def up(manifest: Manifest, *, address: str | None = None, detach: bool = False, out: TextIO = sys.stderr,
       placement_timeout_s: float = 120.0, ready_timeout_s: float = 600.0) -> RunningCluster:
    """Starts the manifest's cluster and returns once it serves. Raises RuntimeError (nothing left running).
    placement_timeout_s: how long each initial replica may wait for Ray to find room for it (on a cloud cluster,
    for the autoscaler to add its node); ready_timeout_s: how long it may then take to load its model."""
    namespace = manifest.ray.namespace
    started = connect(address or manifest.ray.address, namespace, start_if_missing=resources_needed(manifest),
                      host=manifest.ray.host, out=out)
    name = controller_name(manifest.name)
    cluster = None
    try:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            pass
        else:
            raise RuntimeError(f"a cluster named {manifest.name!r} is already running; `tandem down` it first")
        # The controller and the router run on this node: the router's listen address (e.g. 127.0.0.1:50051) is
        # an address of the machine `tandem up` runs on.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        controller = ray.remote(Controller).options(
            name=name, namespace=namespace, num_cpus=0, lifetime="detached" if detach else None,
            max_concurrency=100, scheduling_strategy=here,
        ).remote(manifest, placement_timeout_s=placement_timeout_s, ready_timeout_s=ready_timeout_s,
                  started_ray=started)
        cluster = RunningCluster(manifest.name, namespace, controller, None, started)
        pending = controller.start.remote()
        shown = 0
        while True:
            ready, _ = ray.wait([pending], timeout=0.5)
            lines = ray.get(controller.log.remote(shown))
            for line in lines:
                _tell(out, f"tandem: {line}")
            shown += len(lines)
            if ready:
                break
        endpoints = ray.get(pending)
        cluster.endpoint, cluster.http_endpoint = endpoints["grpc"], endpoints["http"]
    except BaseException as e:  # nothing is left running: what was started, Ray head included, is stopped
        if isinstance(e, KeyboardInterrupt):
            _tell(out, "\ntandem: interrupted while starting; stopping what was started")
        if cluster is not None:
            cluster.shutdown()
        elif started:
            _stop_started_head(None)
        if isinstance(e, ray.exceptions.RayTaskError):  # start() already stopped what it had started
            cause = getattr(e, "cause", None)
            raise RuntimeError(str(cause) if cause is not None else str(e)) from None
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


def down(name: str = "tandem", *, address: str | None = None, namespace: str = "tandem",
         out: TextIO = sys.stderr, drain: bool = False) -> None:
    """Stops the cluster called name, and the Ray head its `tandem up` started. drain: the router drains first
    (router.drain_timeout_s). A local head tandem started whose GCS no longer answers is stopped outright: its
    processes are ended, the cluster's with them. Raises ClusterNotFound."""
    try:
        cluster = find(name, address=address, namespace=namespace)
    except RayHeadNotAnswering as e:
        if e.head is None:
            raise
        ended = local_ray.stop(e.head, grace_s=0)
        _tell(out, f"tandem: the Ray head tandem started at {e.address} does not answer; ended its {ended} "
                   f"process(es), and the cluster's with them")
        return
    cluster.shutdown(drain=drain, out=out)
    _tell(out, f"tandem: cluster {name!r} stopped" + (" (and the local Ray it started)" if cluster.started_ray
                                                      else ""))


def serve_until_stopped(cluster: RunningCluster, out: TextIO = sys.stderr) -> None:
    """Blocks until Ctrl-C, SIGTERM or SIGHUP (with stop_on_signals; then stops the cluster: after draining it on
    SIGTERM, the signal of service managers, Kubernetes and `helm upgrade`; a Ctrl-C during that drain stops at
    once) or until `tandem down` stopped it from elsewhere (then stops the Ray head this `tandem up` started, if
    that is still up)."""
    try:
        while True:
            time.sleep(1.0)
            try:
                state = ray.get(cluster.controller.info.remote(), timeout=10)["state"]
            except (ray.exceptions.RayError, TimeoutError):
                state = "gone"
            if state in ("stopped", "gone"):
                _tell(out, "tandem: the cluster was stopped")
                if cluster.started_ray:
                    _stop_started_head(ray.get_runtime_context().gcs_address)
                return
    except KeyboardInterrupt as e:
        drain = e.args == ("SIGTERM",)
        _tell(out, "\ntandem: stopping (the router drains first)" if drain else "\ntandem: stopping")
        try:
            cluster.shutdown(drain=drain, out=out)
        except KeyboardInterrupt:  # Ctrl-C during the drain: stop now
            _tell(out, "tandem: stopping without waiting for the drain")
            try:
                cluster.shutdown()  # the interrupted call killed the controller, its replicas with it
            except ray.exceptions.RayError:
                pass
