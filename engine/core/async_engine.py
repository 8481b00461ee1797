"""The engine behind an asyncio API: one thread steps LLMEngine, coroutines add, stream, abort and read stats.

Thread contract: only the engine thread touches LLMEngine after start(). Coroutines validate a request on their
own thread (validation is pure), then hand commands to the engine thread, which applies them between steps;
outputs travel back through each request's asyncio queue. abort() returns once the engine thread has freed
the request's blocks; a consumer that stops iterating a stream (cancelled task, closed generator) aborts its
request the same way.

The layers above reach the engine thread in two more ways: call(fn) runs fn(engine) there between steps and
returns its result, and a tick hook (AsyncEngine(engine, tick=...)) runs there every loop iteration; the KV
transfer connectors are polled from it. open_stream()/stream() let a caller collect the outputs of a request it
queued itself through call().
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence as Seq, TypeVar

from tandem.engine.core.llm_engine import EngineStats, LLMEngine
from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.errors import EngineDeadError
from tandem.engine.sampling_params import SamplingParams

_log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, tick: Callable[[], bool] | None = None,
                 idle_poll_s: tuple[float, float] = (0.001, 0.008)):
        """tick: called on the engine thread every loop iteration (before the step); it returns True while it
        waits on something outside the engine (e.g. a KV transfer), which keeps an otherwise idle loop polling:
        first after idle_poll_s[0] seconds, then backing off to idle_poll_s[1] (each poll may cost the ranks a
        wake-up, and on a few shared cores they are the ones computing what is waited for)."""
        self.engine = engine
        self._tick = tick
        self._idle_poll_s = idle_poll_s
        self._poll_s = idle_poll_s[0]
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Aborts every open request and joins the engine thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- the API ---------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None,
                       resume: ResumeState | None = None) -> AsyncIterator[RequestOutput]:
        """Adds a request and yields its outputs until every sample has finished. Raises ValueError /
        RequestRejectedError before the first output for a request that cannot be served, EngineDeadError if
        the engine thread has failed. Leaving the iteration early aborts the request. resume: as in
        LLMEngine.add_request (the outputs start after the delivered tokens)."""
        stream = self.add_request(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                                  resume=resume)
        async for item in self.stream(request_id, stream):
            yield item

    async def stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """Yields the outputs arriving on stream until every sample has finished (an exception delivered on it is
        raised). Leaving early aborts the request."""
        async for batch in self.batches(request_id, stream):
            for item in batch:
                yield item

    async def batches(self, request_id: str, stream: _Stream) -> AsyncIterator[list[RequestOutput]]:
        """Like stream(), but yields every output that has arrived at once as one list (fewer, larger messages
        when a consumer forwards them across processes)."""
        finished = False
        try:
            while not finished:
                items = [await stream.queue.get()]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                batch = []
                for item in items:
                    if isinstance(item, BaseException):
                        if batch:
                            yield batch
                        raise item
                    finished = finished or item.finished
                    batch.append(item)
                yield batch
        finally:
            if not finished:
                await self.abort(request_id)

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None, resume: ResumeState | None = None,
                    tenant: str | None = None) -> _Stream:
        """Validates and queues a request (resume: a migrated request's delivered tokens and seed, as in
        LLMEngine.add_request); returns the stream its outputs arrive on (see generate())."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.validate(prompt_token_ids, params, resume)
        stream = self.open_stream(request_id)

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, priority=priority,
                                        cache_salt=cache_salt, resume=resume, tenant=tenant)
            except Exception as e:  # validated already; a race (e.g. duplicate id) still reaches the caller
                self._deliver(request_id, e, final=True)

        self._submit(add)
        return stream

    def open_stream(self, request_id: str) -> _Stream:
        """Registers the stream the outputs of request_id will be delivered on (the request itself is queued by
        the caller, e.g. through call()). Raises ValueError if the id already has a stream."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        """Forgets a stream whose request never reached the engine."""
        self._streams.pop(request_id, None)

    def deliver(self, request_id: str, item, *, final: bool) -> None:
        """From the engine thread (call() functions, the tick hook): puts an output or an exception on the
        request's stream, if it has one."""
        self._deliver(request_id, item, final=final)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the engine thread between steps and returns its result (or raises its exception)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:
                loop.call_soon_threadsafe(lambda error=e: done.done() or done.set_exception(error))
            else:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        self._submit(run)
        return await done

    async def abort(self, request_id: str) -> None:
        """Ends a request and returns once its blocks are free. Unknown or finished ids are ignored."""
        if self._thread is None or self._error is not None:
            self._streams.pop(request_id, None)
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def abort() -> None:
            for output in self.engine.abort_request(request_id):
                self._deliver(request_id, output, final=output.finished)
            self._streams.pop(request_id, None)
            self._stats = self.engine.stats()  # stats() right after abort() shows the blocks freed
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        self._submit(abort)
        await done

    def stats(self) -> EngineStats:
        """Counters as of the last completed step or command (never blocks on the engine thread)."""
        return self._stats

    @property
    def error(self) -> BaseException | None:
        """What made the engine thread fail (None while it runs or after a clean stop)."""
        return self._error

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._error is None and not self._stopping

    # -- the engine thread ------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error!r}") from self._error
        if self._thread is None or self._stopping:
            raise EngineDeadError("the engine is not running (call start() or use `async with`)")

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item, *, final: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if final:
            self._streams.pop(request_id, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _run(self) -> None:
        try:
            while not self._stopping:
                if not self._commands.empty():
                    while not self._commands.empty():
                        self._commands.get()()
                    self._stats = self.engine.stats()  # reservations and aborts change the counts too
                waiting_outside = self._tick() if self._tick is not None else False
                if not self.engine.has_schedulable_requests():
                    if self.engine.config.check_integrity:  # debug mode: verify KV ownership while idle
                        self.engine.check_integrity()
                    self._wake.wait(timeout=self._poll_s if waiting_outside else 0.5)
                    self._wake.clear()
                    self._poll_s = min(self._poll_s * 2, self._idle_poll_s[1])
                    continue
                self._poll_s = self._idle_poll_s[0]
                outputs = self.engine.step()
                self._stats = self.engine.stats()  # before delivery: a finished stream sees its blocks freed
                for output in outputs:
                    self._deliver(output.request_id, output, final=output.finished)
        except BaseException as e:  # a bug or a device error: fail every stream loudly, never hang them
            self._error = e
            _log.exception("the engine thread failed; every open request is ended with EngineDeadError")
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine failed: {e!r}"), final=True)
        finally:
            while not self._commands.empty():
                self._commands.get()()
            for request_id in list(self._streams):  # stop(): end open streams as aborted
                outputs = self.engine.abort_request(request_id)
                for output in outputs:
                    self._deliver(request_id, output, final=output.finished)
                if not outputs and self._error is None:
                    self._deliver(request_id, EngineDeadError("the engine stopped"), final=True)
                self._streams.pop(request_id, None)
            self._stats = self.engine.stats()
