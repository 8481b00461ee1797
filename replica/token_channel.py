"""The token channel: a decode replica's outputs streamed to the router over one TCP connection per router,
beside the Ray call that asks for them.

Why: a Ray streaming call costs each item a trip through a thread pool and a gRPC report in the replica and a
core-worker hop in the router, about 2 ms of CPU per token in all on the embedded model (bench/cluster_serving.py's
serving path; issue 23). At batch 1 on a small machine that CPU is taken from the engine's torch threads: the
serving path's cost per token was mostly this. Over the channel an item is one pickled frame written from the
replica's event loop and read by the router's.

How a stream goes (replica/remote.py opens it, replica/shell.py answers it):

  1. The router asks the replica for its endpoint once (ReplicaShell.channel_endpoint: host, port and a random
     32-byte secret, over Ray: only members of the Ray cluster learn it) and connects. Both sides prove they
     hold the secret (HMAC-SHA256 over both sides' nonces; ChannelServer/open_channel), and the replica tells
     the router the connection's number, then that it is ready.
  2. For each stream the router makes one Ray call, stream_on_channel(connection, key, call): the replica runs
     the stream the typed call names (replica/contract.py StreamCall: decode / generate / resume, each opening
     its method by reference, never by name) and writes each batch as a frame (key,
     pickled batch) on that connection, then returns a ChannelEnd: how many frames it wrote and the exception
     the stream ended with, if any. The router yields frames until it has that many, then raises the
     exception: the order is the same as over a Ray stream.
  3. The Ray call keeps Ray's meaning for everything else: the replica's death fails it (RayActorError: the
     router migrates the request), and the router cancels it when its consumer leaves early.

A frame's key belongs to one stream of one connection; frames for a key nobody waits on (a stream left early)
are dropped. A connection that closes ends every stream on it: the replica's writes fail (that stream ends
with the error) and the router's waiting streams get the Ray call's answer. Frames carry pickles, which only the
two authenticated ends exchange, as Ray's own calls do (SECURITY.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)

MAGIC = b"TKCH"
NONCE_BYTES = 16
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
_FRAME = struct.Struct("<QI")  # stream key, payload length
_CONNECTION = struct.Struct("<Q")
READY = b"\x01"
MAX_FRAME_BYTES = 1 << 30


class ChannelError(ConnectionError):
    """The token channel failed: it could not be opened, the peer did not prove the secret, or it closed."""


@dataclass(frozen=True)
class ChannelEndpoint:
    host: str
    port: int
    secret: bytes


@dataclass(frozen=True)
class ChannelEnd:
    """What stream_on_channel returns: frames written, and the exception the stream ended with (None: it ended
    normally)."""

    sent: int
    error: BaseException | None = None


def _mac(secret: bytes, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(secret, role + b"".join(nonces), hashlib.sha256).digest()


def encode_frame(key: int, payload: Any) -> bytes:
    data = pickle.dumps(payload, protocol=5)
    return _FRAME.pack(key, len(data)) + data


# -- the replica's side --------------------------------------------------------------------------------------


class ChannelServer:
    """Accepts routers' connections on host (a free port) and writes frames to them."""

    def __init__(self) -> None:
        self.secret = os.urandom(32)
        self._server: asyncio.AbstractServer | None = None
        self._links: dict[int, asyncio.StreamWriter] = {}
        self._numbers = itertools.count(1)
        self.endpoint: ChannelEndpoint | None = None
        self.frames_sent = 0

    async def start(self, host: str) -> ChannelEndpoint:
        if self.endpoint is None:
            self._server = await asyncio.start_server(self._accept, host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self.endpoint = ChannelEndpoint(host, port, self.secret)
        return self.endpoint

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = next(self._numbers)
        try:
            hello = await asyncio.wait_for(reader.readexactly(len(MAGIC) + NONCE_BYTES), HANDSHAKE_TIMEOUT_S)
            if not hello.startswith(MAGIC):
                raise ChannelError("not a token channel client")
            client_nonce, server_nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
            writer.write(server_nonce + _mac(self.secret, b"server", client_nonce, server_nonce)
                         + _CONNECTION.pack(number))
            proof = await asyncio.wait_for(reader.readexactly(MAC_BYTES), HANDSHAKE_TIMEOUT_S)
            if not hmac.compare_digest(proof, _mac(self.secret, b"client", server_nonce, client_nonce)):
                raise ChannelError("the client did not prove the secret")
        except (OSError, EOFError, asyncio.TimeoutError, asyncio.IncompleteReadError, ChannelError) as e:
            _log.warning("token channel: refused a connection from %s: %r", writer.get_extra_info("peername"), e)
            writer.close()
            return
        self._links[number] = writer
        writer.write(READY)  # the connection can carry streams from now on
        try:
            await reader.read()  # the router sends nothing more: this returns when it closes
        finally:
            self._links.pop(number, None)
            writer.close()

    async def send(self, connection: int, key: int, payload: Any) -> None:
        """Writes one frame on `connection`; raises ChannelError if that connection is not open."""
        writer = self._links.get(connection)
        if writer is None or writer.is_closing():
            raise ChannelError(f"token channel connection {connection} is not open")
        writer.write(encode_frame(key, payload))
        self.frames_sent += 1
        await writer.drain()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._links.values()):
            writer.close()
        self._links.clear()


# -- the router's side ---------------------------------------------------------------------------------------


CLOSED = object()  # queued to every open stream when the connection ends


class ChannelClient:
    """One authenticated connection to a replica's ChannelServer; demultiplexes frames into per-stream
    queues."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: int):
        self.connection = connection
        self._writer = writer
        self._queues: dict[int, asyncio.Queue] = {}
        self._keys = itertools.count(1)
        self.closed = False
        self.loop = asyncio.get_running_loop()  # a client serves the event loop that opened it, no other
        self._reading = self.loop.create_task(self._read(reader))

    def open(self) -> tuple[int, asyncio.Queue]:
        """A new stream's key and the queue its frames (then CLOSED, if the connection ends) arrive on."""
        key = next(self._keys)
        queue = self._queues[key] = asyncio.Queue()
        if self.closed:
            queue.put_nowait(CLOSED)
        return key, queue

    def release(self, key: int) -> None:
        self._queues.pop(key, None)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                key, size = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                if size > MAX_FRAME_BYTES:
                    raise ChannelError(f"token channel frame of {size} bytes")
                payload = await reader.readexactly(size)
                queue = self._queues.get(key)
                if queue is not None:
                    queue.put_nowait(pickle.loads(payload))
        except (OSError, EOFError, asyncio.IncompleteReadError, ChannelError, pickle.UnpicklingError) as e:
            if not isinstance(e, asyncio.IncompleteReadError) or e.partial:
                _log.warning("token channel %d closed: %r", self.connection, e)
        finally:
            self.closed = True
            self._writer.close()
            for queue in self._queues.values():
                queue.put_nowait(CLOSED)

    def close(self) -> None:
        self._reading.cancel()


async def open_channel(endpoint: ChannelEndpoint) -> ChannelClient:
    """Connects to a replica's ChannelServer and runs the handshake. Raises ChannelError (the replica did not
    prove the secret) or OSError / asyncio.TimeoutError (it could not be reached)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(endpoint.host, endpoint.port),
                                            HANDSHAKE_TIMEOUT_S)
    try:
        client_nonce = os.urandom(NONCE_BYTES)
        writer.write(MAGIC + client_nonce)
        reply = await asyncio.wait_for(reader.readexactly(NONCE_BYTES + MAC_BYTES + _CONNECTION.size),
                                       HANDSHAKE_TIMEOUT_S)
        server_nonce, mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:NONCE_BYTES + MAC_BYTES]
        if not hmac.compare_digest(mac, _mac(endpoint.secret, b"server", client_nonce, server_nonce)):
            raise ChannelError(f"the replica at {endpoint.host}:{endpoint.port} did not prove the secret")
        (connection,) = _CONNECTION.unpack(reply[NONCE_BYTES + MAC_BYTES:])
        writer.write(_mac(endpoint.secret, b"client", server_nonce, client_nonce))
        await writer.drain()
        if await asyncio.wait_for(reader.readexactly(len(READY)), HANDSHAKE_TIMEOUT_S) != READY:
            raise ChannelError(f"the replica at {endpoint.host}:{endpoint.port} did not take the connection")
    except BaseException:
        writer.close()
        raise
    return ChannelClient(reader, writer, connection)
