"""The transport contract a transfer agent needs: tagged, non-blocking sends and probe-then-receive.

Two implementations keep the same signatures and pass the same contract tests (tests/kv_transfer/
test_transport.py): UCXTransport (kv_transfer/ucx_transport.py, ucxx: TCP or shared memory on CPU hosts, RDMA
and CUDA memory where UCX finds them) and FakeTransport (kv_transfer/fake_transport.py, in-process, with fault
injection).

Rules every transport keeps:
  - send() never blocks on the peer; the Handle says when the buffer may be reused (done: the transport will not
    read it again, also after its connection was closed) and whether it failed (error). A peer that refuses,
    drops or dies fails the handles of its sends, never hangs them.
  - a failed connection is forgotten: the next send to that peer connects anew.
  - probe() looks at the oldest arrived message whose tag matches (tag & mask) without taking it; receive()
    takes exactly that message into a buffer of at least its length. Into a shorter buffer, receive() still
    takes the message off the wire, writes nothing past the buffer (nor anything a caller may rely on), and
    fails the handle (truncated); the sender's send is unaffected. That is how an agent drains a message it
    will not make room for.
  - buffers are uint8 and contiguous: host memory (a numpy array, or anything numpy views without a copy,
    such as a torch CPU tensor), or, only where device_transports is not empty, CUDA device memory (an object
    with __cuda_array_interface__, such as a torch CUDA tensor), whose producer has finished writing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class TransportError(RuntimeError):
    """A transport could not start (bad address, port in use) or was used after close()."""


@dataclass(frozen=True)
class Probe:
    """An arrived message: its full tag and its length in bytes. `token` is the transport's own handle."""

    tag: int
    length: int
    token: object = None


@dataclass(frozen=True)
class Completed:
    """A handle that finished at once: successfully (reason None) or with the reason it failed."""

    reason: str | None = None

    def done(self) -> bool:
        return True

    def error(self) -> str | None:
        return self.reason


class Handle(Protocol):
    def done(self) -> bool:
        """True once the operation finished, successfully or not."""

    def error(self) -> str | None:
        """None while running or after success; the reason after a failure."""


class Transport(Protocol):
    @property
    def address(self) -> str:
        """Where peers reach this transport: "host:port"."""

    @property
    def device_transports(self) -> tuple[str, ...]:
        """The underlying transports that move CUDA device buffers between processes without staging them
        through host memory (UCX: cuda_ipc, RDMA with GPUDirect); empty: pass host buffers only."""

    def send(self, peer: str, tag: int, buffer: np.ndarray) -> Handle:
        """Sends buffer (see the rules above; untouched until the handle is done) to the transport at peer."""

    def probe(self, tag: int, mask: int) -> Probe | None:
        """The oldest arrived message with (message tag & mask) == (tag & mask), or None."""

    def receive(self, probe: Probe, buffer: np.ndarray) -> Handle:
        """Receives the probed message into buffer[:probe.length] (a shorter buffer: drained, the handle
        fails)."""

    def forget_peer(self, peer: str, handle: Handle | None = None) -> None:
        """Closes the connection to peer (failing its sends still running); the next send reconnects. handle: a
        failed send to peer; then only the connection it went over is closed, if it is still the current one."""

    def close(self) -> None:
        """Stops the transport; idempotent."""
