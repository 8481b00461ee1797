"""The OpenAI-compatible HTTP front door, on FastAPI + uvicorn inside the router's event loop:

  POST /v1/chat/completions, POST /v1/completions  (streaming SSE or one JSON body; n; batched completion prompts)
  GET  /v1/models  the model and its LoRA adapters
  POST /v1/load_lora_adapter, /v1/unload_lora_adapter  (vLLM's shapes; the manifest's lora.runtime_loading, and
       with API keys a tenant of lora.admin_tenants)
  GET  /health    200 while the decode pool has a replica and the router is not draining, else 503 (no key needed)
  GET  /metrics   Prometheus exposition (no key needed)

Bodies are parsed by openai_bodies.py, translated by openai_requests.py into the gRPC API's GenerateRequest and
validated by the same code, so both APIs accept and refuse the same requests; replies are built by
openai_responses.py. A failure's gRPC status name becomes an HTTP status and an OpenAI error body
(openai_errors.http_status_for); a request the cluster cannot start in time (admission.py) or a tenant past its
cap gets 429 with Retry-After. OpenAIRoutes holds one handler per route; build_app registers them.

A streamed request's first output is awaited before the response starts, so that every failure before the first
token gets its proper HTTP status; one after that ends the stream with an error event. A client that disconnects
cancels its request on every replica.
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import socket
import time
from functools import lru_cache
from typing import AsyncIterator, Callable, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic.json_schema import models_json_schema

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.admission import AtCapacity
from tandem.router.auth import Unauthenticated
from tandem.router.http_connections import guarded_protocol
from tandem.router.http_limits import parse_limited, read_body
from tandem.router.limits import RequestLimits
from tandem.router.lora_routes import UnknownAdapter
from tandem.router.openai_bodies import ChatCompletionRequest, CompletionRequest, RequestBody
from tandem.router.openai_errors import OpenAIError, http_status_for
from tandem.router.openai_requests import chat_request, completion_requests
from tandem.router.openai_responses import ResponseBuilder, models_body
from tandem.router.request_parsing import CHAT_ROLES, InvalidRequest, ParsedRequest
from tandem.router.serving import Draining, RequestCancelled, Serving, Step, error_code
from tandem.router.tenant_gate import Admission
from tandem.router.tls import TLSConfig, uvicorn_ssl_options
from tandem.router.tool_calls import auto_supported

_DONE = object()


def openai_error(error: BaseException) -> OpenAIError:
    """The OpenAI error reply for a failed request (any exception the serving path raises)."""
    if isinstance(error, OpenAIError):
        return error
    code, message = error_code(error)
    status, kind = http_status_for(code)
    retry_after_s = getattr(error, "retry_after_s", None)  # a refusal to retry later: when
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return OpenAIError(status, message, kind, code="model_not_found" if code == "NOT_FOUND" else code.lower(),
                       headers=headers)


class _Merged:
    """The steps of one HTTP request's prompts (several for a batched completion), each driven in its own task
    (so an Abort or a gone client cancels exactly that request), merged in arrival order."""

    def __init__(self, serving: Serving, parsed: list[ParsedRequest], arrival: float, deadline: float,
                 admission: Admission, trace_parent: str | None = None):
        """admission: one unit per prompt, given back as each prompt's request ends. trace_parent: the client's
        W3C traceparent header."""
        self.trace_parent = trace_parent
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(parsed)
        self.admission = admission
        self.tasks = [asyncio.create_task(self._pump(serving, p, i, arrival, deadline)) for i, p in enumerate(parsed)]
        self.last: dict[int, Step] = {}

    async def _pump(self, serving: Serving, parsed: ParsedRequest, i: int, arrival: float, deadline: float) -> None:
        """Queues each step, then _DONE, the error, or a RequestCancelled when cancel() stopped it."""
        end: object = _DONE
        try:
            async for step in serving.run(parsed, arrival, "http", deadline=deadline, trace_parent=self.trace_parent):
                self.queue.put_nowait((i, step))
        except asyncio.CancelledError:
            end = RequestCancelled(f"request {parsed.request_id!r} was cancelled: the client went away")
            raise
        except Exception as e:
            end = e
        finally:
            self.admission.release()
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


async def _error_reply(request: Request, error: OpenAIError) -> JSONResponse:
    """The app's handler of OpenAIError: OpenAI's error body with the error's HTTP status."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else error.headers
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _http_error_reply(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (an unknown path, a wrong method) as OpenAI error bodies too."""
    return await _error_reply(request, OpenAIError(error.status_code, str(error.detail), code=None,
                                                   headers=dict(error.headers or {}) or None))


async def _events(builder: ResponseBuilder, merged: _Merged, first: tuple[int, Step] | None,
                  n: int) -> AsyncIterator[str]:
    """A streamed reply's server-sent events, from the first step (awaited already) to "[DONE]"."""
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


class OpenAIRoutes:
    """The HTTP API's route handlers over one Serving, one method per route (build_app registers them). A
    handler raises OpenAIError for a failed request; the app turns it into OpenAI's error reply."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.model = serving.model
        self.created = int(time.time())  # the /v1/models creation time: when the front door started
        self.token_text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id], skip_special_tokens=False)

    async def health(self) -> JSONResponse:
        """GET /health: 200 while the decode pool has a replica and the router is not draining, else 503."""
        driver = self.serving.driver
        ready = bool(driver.decode) and not self.serving.draining
        status = "draining" if self.serving.draining else "ok" if ready else "unavailable"
        return JSONResponse({"status": status,
                             "replicas": {"prefill": len(driver.prefill), "decode": len(driver.decode)}},
                            status_code=200 if ready else 503)

    async def metrics(self) -> Response:
        """GET /metrics: the Prometheus exposition."""
        return Response(self.serving.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> JSONResponse:
        """GET /v1/models: the model the cluster serves and its LoRA adapters."""
        self._tenant(request)
        adapters = self.serving.driver.pools.adapters.names
        return JSONResponse(models_body(self.model.model_id, self.created, self.model.max_model_len, adapters))

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"}: every replica serves the adapter (vLLM's shape)."""
        body = await self._lora_body(request, ("lora_name", "lora_path"))
        try:
            seconds = await self.serving.driver.pools.adapters.load(body["lora_name"], body["lora_path"],
                                                                   self.serving.driver.replicas())
        except ValueError as e:
            raise OpenAIError(400, str(e), param="lora_path") from None
        return JSONResponse({"status": "ok", "lora_name": body["lora_name"], "replicas": sorted(seconds)})

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        """POST /v1/unload_lora_adapter {"lora_name"}: no replica serves it any more."""
        body = await self._lora_body(request, ("lora_name",))
        try:
            await self.serving.driver.pools.adapters.unload(body["lora_name"], self.serving.driver.replicas())
        except UnknownAdapter as e:
            raise OpenAIError(404, str(e), type="not_found_error", param="lora_name") from None
        except ValueError as e:
            raise OpenAIError(409, str(e), param="lora_name") from None
        return JSONResponse({"status": "ok", "lora_name": body["lora_name"]})

    async def _lora_body(self, request: Request, keys: tuple[str, ...]) -> dict:
        """The body of a LoRA call, once the caller may make it: runtime loading on (the manifest's
        lora.runtime_loading) and, with API keys on, a tenant of lora.admin_tenants."""
        tenant = self._tenant(request)
        settings = self.serving.driver.settings
        if not settings.lora_runtime_loading:
            raise OpenAIError(403, "loading LoRA adapters at run time is off (the manifest's lora.runtime_loading)",
                              type="permission_error")
        if self.serving.auth.enabled and tenant not in settings.lora_admin_tenants:
            raise OpenAIError(403, f"tenant {tenant!r} may not load or unload LoRA adapters (lora.admin_tenants)",
                              type="permission_error")
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise OpenAIError(400, "the body is not JSON") from None
        for key in keys:
            if not isinstance(body, dict) or not isinstance(body.get(key), str) or not body[key]:
                raise OpenAIError(400, f"{key} must be a non-empty string", param=key)
        if body["lora_name"] == self.model.model_id:
            raise OpenAIError(400, "an adapter cannot take the base model's name", param="lora_name")
        return body

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._complete(request, "chat", ChatCompletionRequest, "chatcmpl",
                                    lambda body, rid: [chat_request(body, rid)])

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: one gRPC request per prompt of a batched body."""
        return await self._complete(request, "completion", CompletionRequest, "cmpl", completion_requests)

    def _tenant(self, request: Request) -> str | None:
        try:
            return self.serving.authenticate(request.headers.get("authorization"), "http")
        except Unauthenticated as e:
            raise openai_error(e) from None

    async def _parse(self, cls: type[RequestBody], request: Request) -> RequestBody:
        """The body as cls, read up to the body limit; a malformed one is counted and raised as OpenAIError
        (413 for a body over the limit, else 400)."""
        limits = self.serving.limits.limits
        try:
            try:
                raw = await asyncio.wait_for(read_body(request, limits.max_body_bytes), limits.body_timeout_s)
            except asyncio.TimeoutError:  # a client that stalls mid-body holds nothing longer than this
                raise OpenAIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                                       f"(router.limits.body_timeout_s)", code="request_timeout") from None
            return await self.serving.off_loop(parse_limited, cls, raw, limits)
        except OpenAIError:
            self.serving.refused("http", "INVALID_ARGUMENT")
            raise

    async def _complete(self, request: Request, kind: Literal["chat", "completion"], body_cls: type[RequestBody],
                        id_prefix: str, to_requests: Callable[[RequestBody, str], list[pb.GenerateRequest]],
                        ) -> Response:
        """Authenticates, parses the body, and serves its gRPC requests (to_requests(body, response_id))."""
        arrival = time.monotonic()
        who = self._tenant(request)
        body = await self._parse(body_cls, request)
        mode = getattr(body, "tool_mode", None)
        if mode is not None and mode.auto and not auto_supported(self.model.tokenizer.chat_template
                                                                 if self.model.tokenizer else None):
            self.serving.refused("http", "INVALID_ARGUMENT")
            raise OpenAIError(400, "tool_choice 'auto' (the default when tools are given) needs a chat template that "
                                   "renders tools and writes calls as <tool_call>...</tool_call>; this model's does "
                                   "not: ask for 'required', a named function, or 'none'", param="tool_choice")
        response_id = f"{id_prefix}-{secrets.token_hex(12)}"
        requests = to_requests(body, response_id)
        try:  # before tokenizing: a refusal costs little
            admission = self.serving.let_in(len(requests), "http", who, arrival, request.headers.get("traceparent"))
        except (InvalidRequest, AtCapacity, Draining) as e:
            raise openai_error(e) from None
        try:
            return await self._serve(request, kind, body, requests, who, arrival, response_id, admission)
        except BaseException:
            admission.close()  # the requests that did start give theirs back as they end
            raise

    async def _serve(self, request: Request, kind: Literal["chat", "completion"],
                     body: ChatCompletionRequest | CompletionRequest, requests: list[pb.GenerateRequest],
                     who: str | None, arrival: float, response_id: str, admission: Admission) -> Response:
        serving = self.serving
        try:
            deadline = serving.deadline(arrival, body.timeout)
            parsed = await asyncio.gather(*(serving.parse(r, who, "http") for r in requests))
        except InvalidRequest as e:
            raise openai_error(e) from None
        n = parsed[0].params.n
        model = parsed[0].params.lora or self.model.model_id  # a LoRA adapter's reply names the adapter
        builder = ResponseBuilder(kind, response_id, model, int(time.time()), self.token_text, n=n * len(parsed),
                                  logprobs=parsed[0].params.logprobs is not None, include_usage=body.include_usage,
                                  tool_mode=getattr(body, "tool_mode", None))
        merged = _Merged(serving, parsed, arrival, deadline, admission, request.headers.get("traceparent"))
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
        return StreamingResponse(_events(builder, merged, first, n), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
# The fields openai_bodies.py validates by hand (a validator, not a type), which pydantic cannot describe.
_HAND_VALIDATED = {
    ("ChatMessage", "role"): {"enum": sorted(CHAT_ROLES)},
    ("ChatMessage", "content"): {"anyOf": [
        {"type": "string"}, {"type": "null"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    ("ChatCompletionRequest", "stop"): _STOP,
    ("CompletionRequest", "stop"): _STOP,
    ("CompletionRequest", "prompt"): {"anyOf": [
        {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
        _TOKEN_IDS | {"minItems": 1}, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]},
}


def _body_schemas() -> dict[str, dict]:
    """The JSON schemas of the two request bodies and the models they hold, by name, as OpenAPI components."""
    _, top = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                ref_template="#/components/schemas/{model}")
    schemas = top["$defs"]
    for (model, field), schema in _HAND_VALIDATED.items():
        schemas[model]["properties"][field] |= copy.deepcopy(schema)
    return schemas


def build_app(serving: Serving) -> FastAPI:
    """The FastAPI app of the OpenAI-compatible API over serving. Its OpenAPI document (app.openapi(), served
    at GET /openapi.json without a key) describes the request bodies the routes accept (openai_bodies.py; the
    handlers read raw bodies, so FastAPI could not derive them) and, with API keys on, the bearer key the
    /v1 routes need."""
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.request_limits = serving.limits.limits  # start_http_server guards connections with them
    routes = OpenAIRoutes(serving)
    app.exception_handler(OpenAIError)(_error_reply)
    app.exception_handler(StarletteHTTPException)(_http_error_reply)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics)
    secured = {"security": [{"bearer": []}]} if serving.auth.enabled else {}
    app.get("/v1/models", openapi_extra=secured or None)(routes.models)
    app.post("/v1/load_lora_adapter", openapi_extra=secured or None)(routes.load_lora_adapter)
    app.post("/v1/unload_lora_adapter", openapi_extra=secured or None)(routes.unload_lora_adapter)
    for path, handler, body in (("/v1/chat/completions", routes.chat_completions, ChatCompletionRequest),
                                ("/v1/completions", routes.completions, CompletionRequest)):
        request_body = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
        app.post(path, openapi_extra={"requestBody": request_body} | secured)(handler)
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            components = generate().setdefault("components", {})
            components.setdefault("schemas", {}).update(_body_schemas())
            if secured:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                            "description": "an API key of the manifest's auth"}}
        return app.openapi_schema

    app.openapi = openapi
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


async def start_http_server(app: FastAPI, address: str, *, tls: TLSConfig | None = None) -> tuple[HttpServer, int]:
    """Serves app on address (HOST:PORT; port 0 picks a free one). Returns the server and its port. tls: serve
    https only (None: plain http); /health and /metrics included. Connections are guarded by the app's
    RequestLimits (router/http_connections.py: a header timeout, a cap per client address). Raises RuntimeError
    if the address cannot be bound, TLSFileError for an unusable TLS file."""
    ssl_options = {} if tls is None else uvicorn_ssl_options(tls)
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets that say they are TCP. Without it
    # a reply on a kept-alive connection waited ~40 ms for the client's delayed ACK (Nagle's algorithm).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {address}: {e.strerror}") from None
    port = sock.getsockname()[1]
    limits = getattr(app.state, "request_limits", None) or RequestLimits()  # build_app's: its Serving's limits
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2,
                            http=guarded_protocol(limits), **ssl_options)
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            error = task.exception() if not task.cancelled() else None
            raise RuntimeError(f"the HTTP server on {address} failed to start: {error!r}")
        await asyncio.sleep(0.01)
    return HttpServer(server, task), port
