"""The OpenAI-compatible HTTP front door, on FastAPI + uvicorn inside the router's event loop:

  POST /v1/chat/completions, POST /v1/completions  (streaming SSE or one JSON body; n; batched completion prompts)
  GET  /v1/models
  GET  /health    200 while the decode pool has a replica, else 503 (no key needed)
  GET  /metrics   Prometheus exposition (no key needed)

Bodies are translated by openai_protocol.py into the gRPC API's GenerateRequest and validated by the same code,
so both APIs accept and refuse the same requests; a failure's gRPC status name becomes an HTTP status and an
OpenAI error body (openai_protocol.http_status_for). A streamed request's first output is awaited before the
response starts, so that every failure before the first token gets its proper HTTP status; one after that ends
the stream with an error event. A client that disconnects cancels its request on every replica.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from functools import lru_cache
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.router.auth import Unauthenticated
from tandem.router.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, ResponseBuilder,
                                           chat_request, completion_requests, http_status_for, models_body,
                                           parse_body)
from tandem.router.request_parsing import InvalidRequest, ParsedRequest
from tandem.router.serving import RequestCancelled, Serving, Step, error_code

_DONE = object()


def openai_error(error: BaseException) -> OpenAIError:
    """The OpenAI error reply for a failed request (any exception the serving path raises)."""
    if isinstance(error, OpenAIError):
        return error
    code, message = error_code(error)
    status, kind = http_status_for(code)
    return OpenAIError(status, message, kind, code="model_not_found" if code == "NOT_FOUND" else code.lower())


def _error_response(error: OpenAIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _Merged:
    """The steps of one HTTP request's prompts (several for a batched completion), each driven in its own task
    (so an Abort or a gone client cancels exactly that request), merged in arrival order."""

    def __init__(self, serving: Serving, parsed: list[ParsedRequest], arrival: float):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(parsed)
        self.tasks = [asyncio.create_task(self._pump(serving, p, i, arrival)) for i, p in enumerate(parsed)]
        self.last: dict[int, Step] = {}

    async def _pump(self, serving: Serving, parsed: ParsedRequest, i: int, arrival: float) -> None:
        """Queues each step, then _DONE, the error, or a RequestCancelled when cancel() stopped it."""
        end: object = _DONE
        try:
            async for step in serving.run(parsed, arrival, "http"):
                self.queue.put_nowait((i, step))
        except asyncio.CancelledError:
            end = RequestCancelled(f"request {parsed.request_id!r} was cancelled: the client went away")
            raise
        except Exception as e:
            end = e
        finally:
            self.queue.put_nowait((i, end))

    async def next(self) -> tuple[int, Step] | None:
        """The next step of any prompt; None once all have finished. Raises the first prompt's error."""
        while self.left:
            i, item = await self.queue.get()
            if item is _DONE:
                self.left -= 1
                continue
            if isinstance(item, BaseException):
                self.cancel()
                raise item
            self.last[i] = item
            return i, item
        return None

    def usage(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens over every prompt."""
        usages = [step.account.usage() for step in self.last.values()]
        return (sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                sum(u.cached_tokens for u in usages))

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def _cancel_on_disconnect(request: Request, merged: _Merged) -> None:
    """Waits for the client to go away (the body is read already, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    merged.cancel()


def build_app(serving: Serving) -> FastAPI:
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    model = serving.model
    created = int(time.time())

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return model.tokenizer.decode([token_id], skip_special_tokens=False)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return _error_response(error)

    def tenant(request: Request) -> str | None:
        try:
            return serving.authenticate(request.headers.get("authorization"), "http")
        except Unauthenticated as e:
            raise openai_error(e) from None

    async def parse(cls, request: Request):
        """The body as cls; a malformed one is counted and raised as OpenAIError."""
        try:
            return parse_body(cls, json.loads(await request.body()))
        except (OpenAIError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            serving.refused("http", "INVALID_ARGUMENT")
            if isinstance(e, OpenAIError):
                raise
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None

    @app.get("/health")
    async def health() -> JSONResponse:
        driver = serving.driver
        ready = bool(driver.decode)
        return JSONResponse({"status": "ok" if ready else "unavailable",
                             "replicas": {"prefill": len(driver.prefill), "decode": len(driver.decode)}},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        tenant(request)
        return JSONResponse(models_body(model.model_id, created, model.max_model_len))

    def endpoint(kind: str, body_cls, id_prefix: str, to_requests):
        async def handle(request: Request) -> Response:
            arrival = time.monotonic()
            who = tenant(request)
            body = await parse(body_cls, request)
            response_id = f"{id_prefix}-{secrets.token_hex(12)}"
            return await serve(request, kind, body, to_requests(body, response_id), who, arrival, response_id)
        return handle

    app.post("/v1/chat/completions")(endpoint("chat", ChatCompletionRequest, "chatcmpl",
                                              lambda body, rid: [chat_request(body, rid)]))
    app.post("/v1/completions")(endpoint("completion", CompletionRequest, "cmpl", completion_requests))

    async def serve(request: Request, kind: str, body, requests, who: str | None, arrival: float,
                    response_id: str) -> Response:
        try:
            parsed = [serving.parse(r, who, "http") for r in requests]
        except InvalidRequest as e:
            raise openai_error(e) from None
        n = parsed[0].params.n
        builder = ResponseBuilder(kind, response_id, model.model_id, int(time.time()), token_text,
                                  n=n * len(parsed), logprobs=parsed[0].params.logprobs is not None,
                                  include_usage=body.include_usage)
        merged = _Merged(serving, parsed, arrival)
        # Until the response starts, a client that disconnects cancels its request (a stream notices by itself).
        watcher = asyncio.create_task(_cancel_on_disconnect(request, merged))
        try:
            first = await merged.next()  # failures before the first output get a proper status
            if not body.stream:
                step = first
                while step is not None:
                    builder.add(step[1].progress.outputs, step[0] * n)
                    step = await merged.next()
                return JSONResponse(builder.response(*merged.usage()))
        except Exception as e:
            merged.cancel()
            raise openai_error(e) from None
        except BaseException:
            merged.cancel()
            raise
        finally:
            watcher.cancel()
        return StreamingResponse(stream(builder, merged, first, n), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream(builder: ResponseBuilder, merged: _Merged, first, n: int) -> AsyncIterator[str]:
        try:
            step = first
            while step is not None:
                for chunk in builder.chunks(step[1].progress.outputs, step[0] * n):
                    yield f"data: {json.dumps(chunk)}\n\n"
                step = await merged.next()
            if builder.include_usage:
                yield f"data: {json.dumps(builder.usage_chunk(*merged.usage()))}\n\n"
        except Exception as e:  # after the first token: the status is sent already; say it in the stream
            yield f"data: {json.dumps(openai_error(e).body())}\n\n"
        finally:
            merged.cancel()  # a client that went away cancels here too
        yield "data: [DONE]\n\n"

    return app


class HttpServer:
    """A uvicorn server running as a task of the current event loop."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task):
        self.server, self.task = server, task

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.task.cancel()


async def start_http_server(app: FastAPI, address: str) -> tuple[HttpServer, int]:
    """Serves app on address (HOST:PORT; port 0 picks a free one). Returns the server and its port. Raises
    RuntimeError if the address cannot be bound."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {address}: {e.strerror}") from None
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            error = task.exception() if not task.cancelled() else None
            raise RuntimeError(f"the HTTP server on {address} failed to start: {error!r}")
        await asyncio.sleep(0.01)
    return HttpServer(server, task), port
