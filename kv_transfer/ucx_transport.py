"""The UCX transport, on ucxx's core API: one UCX worker with its own progress thread, one listener, one
endpoint per peer (created on first send, forgotten on error so the next send reconnects).

UCX picks the wire itself: TCP (or shared memory) between CPU hosts, RDMA and CUDA IPC on GPU clusters. On
TCP its default 8 KB segments cap loopback at about 0.6 GB/s; TransferConfig sets 1 MiB segments (measured:
about 2.8 GB/s cross-process on the 2-core CI machine, docs/BENCHMARKS.md). UCX reads its settings from the
environment when the context is created, so they are set here, from the config, just before that.

CUDA memory: the ucxx wheel's UCX is built with CUDA support, but moves device buffers only where it found a
GPU and reports a CUDA transport for it (cuda_copy, cuda_ipc, gdr_copy; RDMA transports carry device memory
with GPUDirect RDMA). cuda_transports() reads that off the UCX context's resource list; a transport passes
device buffers on only when device_transports (those that move them between processes) is not empty.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np

from tandem.kv_transfer.transport import Completed, Probe, TransportError


ABANDONED_GRACE_S = 5.0  # how long a send on a closed connection may stay incomplete before it counts as done


@dataclass
class _Handle:
    request: object
    buffer: object  # referenced until UCX completes the request: it reads or writes it until then
    endpoint: object = None  # the connection a send went over (None: a receive)
    abandoned: str | None = None  # set when its endpoint was closed
    abandoned_at: float = 0.0

    def done(self) -> bool:
        """Whether UCX is finished with the buffer. Closing an endpoint does not stop UCX at once: a send still
        queued on a connection being set up is flushed out after the close, reading its buffer then (a buffer
        reused earlier went out garbled and failed its MAC at the peer: issue 48). A request that never
        completes after its endpoint closed counts as done after ABANDONED_GRACE_S (the transport keeps its
        buffer regardless)."""
        if self.request.completed:
            return True
        return self.abandoned is not None and time.monotonic() - self.abandoned_at > ABANDONED_GRACE_S

    def error(self) -> str | None:
        if self.abandoned is not None:
            return self.abandoned if self.done() else None
        if not self.request.completed:
            return None
        try:
            self.request.check_error()
        except Exception as e:  # ucxx raises one UCXError subclass per UCS status
            return f"{type(e).__name__}: {e}"
        return None


_KEPT: list = []


def _close(ep) -> None:
    """Closes an endpoint that is still up. One whose peer already went away was torn down by UCX's error
    handling, and closing it again crashes the process."""
    try:
        if ep.alive:
            ep.close()
    except Exception:
        pass


def _check_listening(host: str, port: int, timeout_s: float = 2.0) -> None:
    """Raises ConnectionError unless something accepts TCP connections at host:port. UCX reports a refused
    sockaddr connection only through the endpoint's error handler, and a send posted on that endpoint after the
    failure spins forever inside UCX (ucxx 0.52 / UCX 1.21): ask the port first."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass


# "#      resource 6  :  md 5  dev 4  flags -- cuda_ipc/cuda" in ucp_context_print_info's output
_RESOURCE = re.compile(r"^#\s*resource\s+\d+\s*:.*\s(\S+)/(\S+)\s*$", re.MULTILINE)
_CUDA_TLS = ("cuda_copy", "cuda_ipc", "gdr_copy")
_RDMA_TL_PREFIXES = ("rc_", "dc_", "ud_")  # rc_verbs, rc_mlx5, dc_mlx5, ud_verbs, ud_mlx5
# The GPUDirect RDMA kernel modules, where UCX's InfiniBand memory domain looks for them (nv_peer_mem, the
# older out-of-tree module, and nvidia-peermem, shipped with the driver). DMA-BUF registration is not checked.
_PEER_MEMORY = ("/sys/kernel/mm/memory_peers/nv_mem/version", "/sys/module/nvidia_peermem/version")
_log = logging.getLogger(__name__)


def gpudirect_rdma() -> bool:
    """Whether this host's kernel lets RDMA NICs read and write GPU memory (a GPUDirect RDMA module is loaded)."""
    return any(os.path.exists(path) for path in _PEER_MEMORY)


def cuda_transports(context_info: str | None = None, *, gpudirect: bool | None = None) -> tuple[str, ...]:
    """The UCX transports that carry CUDA device memory, in UCX's order: cuda_copy (device <-> host inside a
    process: UCX stages device buffers through host memory itself), cuda_ipc (between processes on one host,
    over NVLink or PCIe), gdr_copy (small copies through a CPU mapping of GPU memory), and the RDMA transports
    (rc_*, dc_*, ud_*) when GPUDirect RDMA is loaded. Empty where UCX found no GPU (this build without a
    device), was built without CUDA, or UCX_TLS leaves the CUDA transports out.

    context_info: a UCX context's ucp_context_print_info text (UCXContext.info); None creates a context (with
    the UCX_* environment as it is now) just to read it. gpudirect: None checks this host (gpudirect_rdma())."""
    if context_info is None:
        import ucxx._lib.libucxx as ucx

        context_info = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,)).info
    rdma = gpudirect_rdma() if gpudirect is None else gpudirect
    found: list[str] = []
    for tl, _device in _RESOURCE.findall(context_info):
        if tl in found:
            continue
        if tl in _CUDA_TLS or (rdma and tl.startswith(_RDMA_TL_PREFIXES)):
            found.append(tl)
    return tuple(found)


def between_processes(transports: tuple[str, ...]) -> tuple[str, ...]:
    """Those of cuda_transports() that move device memory from one process to another without a host bounce:
    cuda_copy and gdr_copy alone only copy within a process (UCX would stage device buffers through host
    memory, as the agent's own staged path does, with its MAC overlapped)."""
    return tuple(t for t in transports if t not in ("cuda_copy", "gdr_copy"))


def _bind_cuda_device(index: int) -> None:
    """Runs first on UCX's progress thread: makes the device's primary CUDA context current there, for the
    copies UCX's CUDA transports run on that thread (as ucxx's own benchmarks do before CUDA transfers)."""
    try:
        import torch

        torch.cuda.set_device(index)
        torch.cuda.synchronize(index)  # a runtime call on this thread binds the device's primary context to it
    except Exception as e:  # UCX's thread must not die of it; transfers of device memory then fail visibly
        _log.warning("could not make CUDA device %d current on the UCX progress thread: %s", index, e)


def _ucx_array(buffer):
    """ucxx takes host memory through the buffer protocol and device memory through __cuda_array_interface__;
    a torch CPU tensor offers neither, and numpy views it without a copy."""
    from ucxx._lib.arr import Array

    if isinstance(buffer, np.ndarray) or hasattr(buffer, "__cuda_array_interface__"):
        return Array(buffer)
    return Array(np.asarray(buffer))


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad transfer address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


class UCXTransport:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, ucx_env: dict[str, str] | None = None,
                 cuda_device: int | None = None):
        """Listens on port (0: any free one) and advertises host:port. ucx_env: UCX_* settings applied before
        the UCX context is created (setdefault: what the operator exported wins). cuda_device: the index of the
        GPU whose memory this transport may be handed (its context is made current on UCX's progress thread).
        Raises TransportError."""
        for name, value in (ucx_env or {}).items():
            os.environ.setdefault(name, value)
        import ucxx._lib.libucxx as ucx

        self._ucx = ucx
        self._lock = threading.Lock()  # our dicts and lists
        # ucxx calls from our threads, one at a time: a worker-level probe and an endpoint send racing each other
        # from two threads can deadlock inside ucxx (seen with an endpoint to a dead peer).
        self._ucx_lock = threading.RLock()
        self._endpoints: dict[str, object] = {}
        self._inbound: list[object] = []  # endpoints peers opened to us; held so they stay alive
        self._in_flight: dict[str, list[_Handle]] = {}  # peer -> sends held (with their buffers) until done
        self._abandoned: list[_Handle] = []  # sends of closed connections, held until UCX completes them
        self._closed = False
        try:
            self._context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
            self._cuda_transports = cuda_transports(self._context.info)
            self._worker = ucx.UCXWorker(self._context)
            if cuda_device is not None:
                self._worker.set_progress_thread_start_callback(_bind_cuda_device, cb_args=(cuda_device,))
            self._worker.start_progress_thread(polling_mode=False)
            self._listener = ucx.UCXListener.create(worker=self._worker, port=port, cb_func=self._accept)
        except Exception as e:
            raise TransportError(f"cannot start a UCX listener on port {port}: {e}") from e
        self._address = f"{host}:{self._listener.port}"

    def _accept(self, conn_request) -> None:
        """Runs on UCX's progress thread: takes no lock a caller could hold while waiting on that thread."""
        ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        self._inbound = [e for e in self._inbound if e.alive] + [ep]

    @property
    def address(self) -> str:
        return self._address

    @property
    def cuda_transports(self) -> tuple[str, ...]:
        """cuda_transports() of this transport's UCX context."""
        return self._cuda_transports

    @property
    def device_transports(self) -> tuple[str, ...]:
        return between_processes(self._cuda_transports)

    def _endpoint(self, peer: str):
        with self._ucx_lock:
            if self._closed:
                raise TransportError("the transport is closed")
            ep = self._endpoints.get(peer)
            if ep is not None and not ep.alive:
                self._endpoints.pop(peer)
                ep = None
            if ep is None:
                host, port = split_address(peer)
                _check_listening(host, port)
                ep = self._ucx.UCXEndpoint.create(self._worker, host, port, True)
                self._endpoints[peer] = ep
            return ep

    def send(self, peer: str, tag: int, buffer: np.ndarray):
        try:
            with self._ucx_lock:
                ep = self._endpoint(peer)
                if not ep.alive:  # UCX spins forever in a send on an endpoint that has already failed
                    raise ConnectionError("the connection failed")
                handle = _Handle(ep.tag_send(_ucx_array(buffer), self._ucx.UCXXTag(tag)), buffer, ep)
                self._in_flight[peer] = [h for h in self._in_flight.get(peer, ()) if not h.done()] + [handle]
                self._abandoned = [h for h in self._abandoned if not h.request.completed]
            return handle
        except TransportError:
            raise
        except Exception as e:  # refused at once, unreachable host, ...
            self.forget_peer(peer)
            return Completed(f"cannot send to {peer}: {type(e).__name__}: {e}")

    def probe(self, tag: int, mask: int) -> Probe | None:
        with self._ucx_lock:
            result = self._worker.tag_probe(self._ucx.UCXXTag(tag), self._ucx.UCXXTagMask(mask), remove=False)
        if not result.matched:
            return None
        tag = result.sender_tag
        return Probe(int(getattr(tag, "value", tag)), result.length)

    def receive(self, probe: Probe, buffer: np.ndarray):
        with self._ucx_lock:
            taken = self._worker.tag_probe(self._ucx.UCXXTag(probe.tag), self._ucx.UCXXTagMaskFull, remove=True)
            if not taken.matched:
                return Completed(f"message with tag {probe.tag:#x} vanished between probe and receive")
            return _Handle(self._worker.tag_recv_with_handle(_ucx_array(buffer[:taken.length]), taken), buffer)

    def forget_peer(self, peer: str, handle: object = None) -> None:
        """handle: one of this transport's sends to peer that failed; then only the connection it went over is
        closed, and nothing if that one is gone already (a newer one may carry what was sent since, such as the
        ABORT telling peer about that failure)."""
        with self._ucx_lock:
            ep = self._endpoints.get(peer)
            if handle is not None and getattr(handle, "endpoint", None) is not ep:
                return
            self._endpoints.pop(peer, None)
            if ep is not None:
                _close(ep)
            now = time.monotonic()
            for sent in self._in_flight.pop(peer, ()):
                if not sent.request.completed:
                    sent.abandoned, sent.abandoned_at = f"the connection to {peer} was closed", now
                    self._abandoned.append(sent)

    def close(self) -> None:
        with self._ucx_lock:
            if self._closed:
                return
            self._closed = True
            endpoints = list(self._endpoints.values()) + self._inbound
            self._endpoints.clear()
            self._inbound = []
            for ep in endpoints:
                _close(ep)
            self._worker.stop_progress_thread()
            # Kept until the process exits: destroying a UCX listener while a peer's connection request to it
            # is in flight crashes UCX's async thread (UCX 1.21, seen in tests that start and stop transports
            # in one process). A rank closes its transport only when its process ends anyway.
            _KEPT.append((self._listener, self._worker, self._context, endpoints, self._abandoned))
        self._listener = None
