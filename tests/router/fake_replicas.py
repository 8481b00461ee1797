"""A mock engine behind Ray-like actor handles (STYLE.md): deterministic tokens and a configurable step latency,
so the router's request driver runs its real code paths (reserve, prefill, decode, fallback, abort) in
milliseconds without Ray or a model. `handle.method.remote(...)` returns an awaitable, and with
`.options(num_returns="streaming")` an async iterator of awaitables, as Ray's handles do."""

from __future__ import annotations

import asyncio

from tandem.engine.output_processor import RequestOutput
from tandem.engine.sampler import SampledToken
from tandem.kv_transfer.connector_loop import TransferFailedError
from tandem.kv_transfer.descriptor import TransferState
from tandem.prefill_worker.replica import PrefillResult


class _Method:
    def __init__(self, fn, streaming: bool = False):
        self.fn, self.streaming = fn, streaming

    def options(self, num_returns=None):
        return _Method(self.fn, num_returns == "streaming")

    def remote(self, *args, **kwargs):
        if not self.streaming:
            return self.fn(*args, **kwargs)

        async def refs():
            async for item in self.fn(*args, **kwargs):
                future = asyncio.get_running_loop().create_future()
                future.set_result(item)
                yield future

        return refs()


class FakeHandle:
    def __init__(self, replica):
        self.replica = replica

    def __getattr__(self, name):
        return _Method(getattr(self.replica, name))


def token_for(prompt: tuple[int, ...], i: int) -> int:
    """The mock model: token i of a completion depends only on the prompt."""
    return (sum(prompt) * 31 + i * 7) % 1000


def _output(request_id, prompt, tokens, i0, finished, cached=0) -> RequestOutput:
    return RequestOutput(request_id, 0, tuple(tokens), "".join(f"<{t}>" for t in tokens), None,
                         "length" if finished else None, len(prompt), cached, finished)


class FakeDecode:
    def __init__(self, name: str, *, room: list[bool] | None = None, step_s: float = 0.0):
        """room: reserve() answers from this list in turn (True: a descriptor, False: no room), then True."""
        self.name, self.room, self.step_s = name, list(room or []), step_s
        self.aborted: list[str] = []
        self.reservations: dict[str, tuple] = {}

    async def reserve(self, request_id, prompt, params, priority=0):
        if self.room and not self.room.pop(0):
            return None
        self.reservations[request_id] = (tuple(prompt), params)
        return {"transfer_id": f"{request_id}/0"}

    async def decode(self, request_id, first: SampledToken):
        prompt, params = self.reservations.pop(request_id)
        tokens = [first.token_id] + [token_for(prompt, i) for i in range(1, params.max_tokens)]
        async for batch in self._stream(request_id, prompt, tokens):
            yield batch

    async def generate(self, request_id, prompt, params, priority=0):
        tokens = [token_for(tuple(prompt), i) for i in range(params.max_tokens)]
        async for batch in self._stream(request_id, tuple(prompt), tokens):
            yield batch

    async def _stream(self, request_id, prompt, tokens):
        for i, token in enumerate(tokens):
            await asyncio.sleep(self.step_s)
            yield [_output(request_id, prompt, [token], i, i == len(tokens) - 1)]

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.reservations.pop(request_id, None)


class FakePrefill:
    def __init__(self, name: str, *, fail: TransferState | None = None, step_s: float = 0.0):
        self.name, self.fail, self.step_s = name, fail, step_s
        self.aborted: list[str] = []
        self.prefilled: list[str] = []

    async def prefill(self, request_id, prompt, params, descriptor, priority=0):
        await asyncio.sleep(self.step_s)
        self.prefilled.append(request_id)
        if self.fail is not None:
            raise TransferFailedError(request_id, self.fail, "the peer went away")
        return PrefillResult(SampledToken(token_for(tuple(prompt), 0), None, ()), len(prompt), 16)

    async def abort(self, request_id):
        self.aborted.append(request_id)


class DyingDecode(FakeDecode):
    """Dies (as Ray reports a dead actor) after streaming `after` outputs of a request."""

    def __init__(self, name: str, after: int):
        super().__init__(name)
        self.after = after

    async def _stream(self, request_id, prompt, tokens):
        from ray.exceptions import RayActorError

        async for i, batch in _enumerate(super()._stream(request_id, prompt, tokens)):
            if i == self.after:
                raise RayActorError()
            yield batch

    async def reserve(self, request_id, prompt, params, priority=0):
        if self.after < 0:
            from ray.exceptions import RayActorError

            raise RayActorError()
        return await super().reserve(request_id, prompt, params, priority)


async def _enumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1
