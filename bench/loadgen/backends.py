"""How a request is sent and timed: tandem's gRPC API (GrpcBackend) or any OpenAI-compatible HTTP server
(OpenAIBackend: tandem's, vLLM's, SGLang's, llama.cpp's), both streaming. Each fills a RequestRecord as messages
arrive (records.py Backend); neither raises for a failed request, it records the failure's kind."""

from __future__ import annotations

import asyncio
import itertools
import json

import grpc

from tandem.bench.loadgen.records import Clock, RequestRecord, WorkRequest
from tandem.proto.v1 import tandem_pb2 as pb
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.client import build_request, channel_credentials


def _sampling(request: WorkRequest) -> dict:
    return {"max_tokens": request.max_tokens, "temperature": request.temperature, "ignore_eos": request.ignore_eos}


class GrpcBackend:
    """tandem's Generate stream. Requests spread over `channels` HTTP/2 connections. Prompt ids go out as token
    ids (exact lengths), texts as text, chats as chat messages."""

    def __init__(self, target: str, *, api_key: str | None = None, tls_ca: str | None = None,
                 timeout_s: float = 600.0, channels: int = 4):
        credentials = None if tls_ca is None else channel_credentials(tls_ca)
        self.name = f"grpc://{target}"
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.channels = [grpc.aio.insecure_channel(target) if credentials is None
                         else grpc.aio.secure_channel(target, credentials) for _ in range(max(1, channels))]
        self._stubs = itertools.cycle([pb_grpc.TandemStub(c) for c in self.channels])

    def message(self, request: WorkRequest) -> pb.GenerateRequest:
        if request.prompt_ids is not None:
            message = build_request(token_ids=request.prompt_ids, **_sampling(request))
        elif request.text is not None:
            message = build_request(prompt=request.text, **_sampling(request))
        else:
            message = build_request(chat=[{"role": r, "content": c} for r, c in request.messages or ()],
                                    **_sampling(request))
        if request.session_id:
            message.session_id = request.session_id
        return message

    async def send(self, request: WorkRequest, record: RequestRecord, clock: Clock) -> str:
        texts: list[str] = []
        counted = 0
        call = next(self._stubs).Generate(self.message(request), timeout=self.timeout_s, metadata=self.metadata)
        record.sent_s = clock.now()
        try:
            async for message in call:
                now = clock.now()
                if message.index == 0:
                    texts.append(message.text)
                record.on_tokens(now, len(message.token_ids))
                counted += len(message.token_ids)
                if message.HasField("usage"):
                    record.prompt_tokens = message.usage.prompt_tokens
                    record.cached_tokens = message.usage.cached_tokens
                    record.output_tokens = message.usage.completion_tokens
                    t = message.timings
                    record.server_timings = {field.name: getattr(t, field.name) for field in t.DESCRIPTOR.fields}
            record.end_s = clock.now()
            record.output_tokens = record.output_tokens or counted
        except grpc.aio.AioRpcError as e:
            record.fail(e.code().name, e.details() or "")
        except asyncio.CancelledError:
            call.cancel()
            record.fail("cancelled", "the run ended before the request finished")
            raise
        return "".join(texts)

    async def aclose(self) -> None:
        for channel in self.channels:
            await channel.close()


class OpenAIBackend:
    """POST /v1/completions (prompt ids as their text, or raw text) or /v1/chat/completions (chats), streamed with
    usage (stream_options.include_usage). Every chunk with new text counts as one token arriving (servers send one
    chunk per token; a chunk carrying more still counts as one inter-token gap), and the usage chunk's
    completion_tokens gives the request's output tokens."""

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, detokenize=None, token_prompts: bool = False):
        """base_url: the server's root or its /v1 URL. model: the model name to send (None: the first of
        GET /v1/models). detokenize: token ids -> text for prompt_ids requests (the served model's tokenizer).
        token_prompts: send prompt_ids as a list of token ids instead (vLLM, llama.cpp and tandem accept it)."""
        import httpx

        root = base_url.rstrip("/")
        self.base = root if root.endswith("/v1") else root + "/v1"
        self.name = self.base
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=30.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.model, self.detokenize, self.token_prompts = model, detokenize, token_prompts

    async def _model(self) -> str:
        if self.model is None:
            reply = await self.client.get(f"{self.base}/models")
            reply.raise_for_status()
            models = reply.json().get("data") or []
            if not models:
                raise ValueError(f"{self.base}/models lists no model; pass --model")
            self.model = models[0]["id"]
        return self.model

    def body(self, request: WorkRequest, model: str) -> tuple[str, dict]:
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True}} | _sampling(request)
        if request.session_id:
            body["session_id"] = request.session_id
        if request.messages is not None:
            return "chat/completions", body | {"messages": [{"role": r, "content": c} for r, c in request.messages]}
        if request.prompt_ids is not None:
            prompt = list(request.prompt_ids) if self.token_prompts or self.detokenize is None \
                else self.detokenize(list(request.prompt_ids))
            return "completions", body | {"prompt": prompt}
        return "completions", body | {"prompt": request.text}

    async def send(self, request: WorkRequest, record: RequestRecord, clock: Clock) -> str:
        import httpx

        texts: list[str] = []
        counted = 0
        try:
            path, body = self.body(request, await self._model())
            record.sent_s = clock.now()
            async with self.client.stream("POST", f"{self.base}/{path}", json=body) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    record.fail(f"http_{reply.status_code}", text)
                    return ""
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    now = clock.now()
                    if "error" in chunk:
                        record.fail("stream_error", json.dumps(chunk["error"]))
                        return "".join(texts)
                    for choice in chunk.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        if piece and choice.get("index", 0) == 0:
                            texts.append(piece)
                            record.on_tokens(now, 1)
                            counted += 1
                    if usage := chunk.get("usage"):
                        record.prompt_tokens = usage.get("prompt_tokens", 0)
                        record.output_tokens = usage.get("completion_tokens", 0)
                        details = usage.get("prompt_tokens_details") or {}
                        record.cached_tokens = details.get("cached_tokens")
            record.end_s = clock.now()
            record.output_tokens = record.output_tokens or counted
        except httpx.TimeoutException as e:
            record.fail("timeout", str(e))
        except (httpx.TransportError, OSError) as e:
            record.fail("connection", str(e) or type(e).__name__)
        except (ValueError, KeyError) as e:
            record.fail("bad_reply", str(e))
        return "".join(texts)

    async def aclose(self) -> None:
        await self.client.aclose()
