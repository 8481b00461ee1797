"""The token channel (replica/token_channel.py) and the router's side of a stream over it (replica/remote.py's
_channel_stream), on loopback in this process: the handshake proves the secret both ways, frames reach the
stream they belong to, a stream yields every batch the replica counted before it raises the stream's error,
and a closed connection or a failed call ends it with an error instead of a hang. The cluster tests run every
decode stream over it (tests/cluster/test_colocated_and_moe.py checks it was used)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.replica.contract import GenerateCall
from tandem.replica.remote import _channel_stream
from tandem.replica.token_channel import ChannelEnd, ChannelError, ChannelServer, open_channel

CALL = GenerateCall("req-1", [1, 2, 3], SamplingParams(max_tokens=4))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_frames_reach_their_stream_after_a_handshake_both_ways():
    async def scenario():
        server = ChannelServer()
        endpoint = await server.start("127.0.0.1")
        client = await open_channel(endpoint)
        (a, qa), (b, qb) = client.open(), client.open()
        await server.send(client.connection, b, ["for b"])
        await server.send(client.connection, a, {"for": "a"})
        await server.send(client.connection, 999, "nobody waits on this key")
        got = await qa.get(), await qb.get()
        client.close()
        await server.close()
        return got, server.frames_sent

    got, sent = run(scenario())
    assert got == ({"for": "a"}, ["for b"])
    assert sent == 3


def test_a_wrong_secret_is_refused_and_an_unknown_connection_cannot_be_written():
    async def scenario():
        server = ChannelServer()
        endpoint = await server.start("127.0.0.1")
        with pytest.raises(ChannelError, match="did not prove the secret"):
            await open_channel(dataclasses.replace(endpoint, secret=b"x" * 32))
        # something that is not a client at all
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await reader.read() == b""  # closed without a word
        writer.close()
        with pytest.raises(ChannelError, match="not open"):
            await server.send(12345, 1, "x")
        assert not server._links
        await server.close()

    run(scenario())


class FakeDecodeActor:
    """Answers stream_on_channel as ReplicaShell does, from a script of batches, over a real ChannelServer."""

    def __init__(self, server: ChannelServer, batches: list, error: BaseException | None = None, *,
                 die: BaseException | None = None):
        self.server, self.batches, self.error, self.die = server, batches, error, die
        self.calls = []
        outer = self

        class Method:
            def remote(self, connection, key, call):
                outer.calls.append(call)
                return outer._stream(connection, key)

        self.stream_on_channel = Method()

    async def _stream(self, connection, key):
        for batch in self.batches:
            await self.server.send(connection, key, batch)
        if self.die is not None:
            raise self.die
        return ChannelEnd(len(self.batches), self.error)


def collect(actor_for, *, close_after: int | None = None):
    async def scenario():
        server = ChannelServer()
        client = await open_channel(await server.start("127.0.0.1"))
        actor = actor_for(server)
        got, error = [], None
        try:
            async for batch in _channel_stream(actor, client, CALL):
                got.append(batch)
                if close_after is not None and len(got) == close_after:
                    await server.close()  # the connection drops under the stream
        except Exception as e:
            error = e
        client.close()
        await server.close()
        return actor, got, error

    return run(scenario())


def test_a_stream_yields_every_counted_batch_in_order_then_its_error():
    batches = [[f"token {i}"] for i in range(50)]
    actor, got, error = collect(lambda s: FakeDecodeActor(s, batches, ValueError("the replica refused it")))
    assert got == batches
    assert isinstance(error, ValueError) and "refused" in str(error)
    assert actor.calls == [CALL]


def test_a_stream_that_ends_normally_raises_nothing():
    actor, got, error = collect(lambda s: FakeDecodeActor(s, [["a"], ["b"]]))
    assert (got, error) == ([["a"], ["b"]], None)


def test_a_failed_call_raises_after_what_arrived():
    class ActorDied(Exception):
        pass

    actor, got, error = collect(lambda s: FakeDecodeActor(s, [["a"], ["b"]], die=ActorDied("gone")))
    assert isinstance(error, ActorDied)
    assert got == [["a"], ["b"]][:len(got)]  # a prefix: what was read before the call's answer


def test_a_connection_that_closes_mid_stream_ends_it_with_an_error():
    class SlowActor(FakeDecodeActor):
        async def _stream(self, connection, key):
            sent = 0
            try:
                for batch in self.batches:
                    await self.server.send(connection, key, batch)
                    sent += 1
                    await asyncio.sleep(0.01)
            except ChannelError as e:
                return ChannelEnd(sent, e)
            return ChannelEnd(sent)

    actor, got, error = collect(lambda s: SlowActor(s, [[i] for i in range(100)]), close_after=3)
    assert isinstance(error, ChannelError)
    assert 3 <= len(got) < 100
