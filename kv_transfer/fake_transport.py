"""An in-process transport with UCXTransport's signatures: transports on one Fabric deliver to each other's
inboxes by copying. It passes the same contract tests, so agent and connector logic is tested without UCX;
kill() makes a transport vanish the way a dead process does (its peers' sends fail, nothing it held answers).
"""

from __future__ import annotations

import itertools
import threading
import numpy as np

from tandem.kv_transfer.transport import Completed, Probe, TransportError


class Fabric:
    """The shared medium: address -> transport."""

    def __init__(self):
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self.transports: dict[str, FakeTransport] = {}

    def attach(self, transport: FakeTransport) -> str:
        with self._lock:
            address = f"fake:{next(self._numbers)}"
            self.transports[address] = transport
            return address

    def detach(self, address: str) -> None:
        with self._lock:
            self.transports.pop(address, None)

    def lookup(self, address: str) -> FakeTransport | None:
        with self._lock:
            return self.transports.get(address)


class FakeTransport:
    def __init__(self, fabric: Fabric):
        self._fabric = fabric
        self._lock = threading.Lock()
        self._inbox: list[tuple[int, bytes]] = []  # arrival order
        self._closed = False
        self._address = fabric.attach(self)

    @property
    def address(self) -> str:
        return self._address

    @property
    def device_transports(self) -> tuple[str, ...]:
        return ()  # host memory only: bytes are copied with numpy

    def _deliver(self, tag: int, data: bytes) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._inbox.append((tag, data))
            return True

    def send(self, peer: str, tag: int, buffer: np.ndarray):
        if self._closed:
            raise TransportError("the transport is closed")
        target = self._fabric.lookup(peer)
        if target is None or not target._deliver(tag, np.asarray(buffer).tobytes()):
            return Completed(f"cannot send to {peer}: connection refused (no transport listens there)")
        return Completed()

    def probe(self, tag: int, mask: int) -> Probe | None:
        with self._lock:
            for i, (message_tag, data) in enumerate(self._inbox):
                if message_tag & mask == tag & mask:
                    return Probe(message_tag, len(data), i)
        return None

    def receive(self, probe: Probe, buffer: np.ndarray):
        with self._lock:
            for i, (message_tag, data) in enumerate(self._inbox):
                if message_tag == probe.tag:
                    del self._inbox[i]
                    break
            else:
                return Completed(f"message with tag {probe.tag:#x} vanished between probe and receive")
        if len(buffer) < len(data):
            return Completed(f"buffer of {len(buffer)} bytes is too small for a {len(data)}-byte message")
        np.asarray(buffer)[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return Completed()

    def forget_peer(self, peer: str, handle: object = None) -> None:
        pass  # no connection state to drop

    def kill(self) -> None:
        """Vanishes like a dead process: unreachable at once, its inbox lost."""
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._inbox.clear()
        self._fabric.detach(self._address)
