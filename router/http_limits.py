"""The HTTP API's body limits (router/limits.py RequestLimits), held before a body costs the router more than
its size: read_body keeps nothing past max_body_bytes (413), decode_json refuses invalid or too deeply nested
JSON (400, never a 500 from the decoder's recursion), check_body bounds the counts the gRPC requests are built
from (prompts of a batched completion, chat messages). decode_json and check_body block: the HTTP front door
runs them on the router's parse threads."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import ClientDisconnect, Request

from tandem.router.limits import RequestLimits
from tandem.router.openai_bodies import ChatCompletionRequest, CompletionRequest, parse_body
from tandem.router.openai_errors import OpenAIError


def _too_large(size: str, limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is {size} bytes; this server takes at most {limit} "
                            f"(router.limits.max_body_bytes)", code="request_too_large")


DRAIN_BYTES = 16 << 20  # past the limit, read and dropped before the 413 goes out...
DRAIN_S = 2.0  # ...for at most this long


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, read in chunks. Raises OpenAIError(413) once the declared or received length passes max_bytes,
    OpenAIError(400) when the client went away mid-body. Nothing past max_bytes is kept, but a body that ends
    within DRAIN_BYTES more (and DRAIN_S) is read to its end and dropped before the 413: a server that closes a
    connection with the client's bytes unread resets it, and the reset can destroy the 413 on its way (the
    client then sees its status line and no error object, or nothing). A larger body gets the 413 at once."""
    declared = request.headers.get("content-length")
    too_large = None
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        too_large = _too_large(declared, max_bytes)
        if int(declared) > max_bytes + DRAIN_BYTES:
            raise too_large
    chunks, size, drain_until = [], 0, None
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes and too_large is None:
                too_large = _too_large(f"more than {max_bytes}", max_bytes)
            if too_large is None:
                chunks.append(chunk)
                continue
            chunks.clear()
            loop = asyncio.get_running_loop()
            drain_until = drain_until or loop.time() + DRAIN_S
            if size > max_bytes + DRAIN_BYTES or loop.time() > drain_until:
                break
    except ClientDisconnect:
        if too_large is None:
            raise OpenAIError(400, "the client went away before sending the whole body") from None
    if too_large is not None:
        raise too_large
    return b"".join(chunks)


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether value nests lists/objects more than limit deep (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def decode_json(body: bytes, max_depth: int) -> Any:
    """The decoded body. Raises OpenAIError(400) for bytes that are not UTF-8 JSON or nest deeper than
    max_depth."""
    try:
        data = json.loads(body)
    except RecursionError:  # the decoder gave up on the nesting before our own check could
        raise OpenAIError(400, f"the request body nests deeper than {max_depth} levels") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    if _depth_exceeds(data, max_depth):
        raise OpenAIError(400, f"the request body nests deeper than {max_depth} levels")
    return data


def check_body(body: ChatCompletionRequest | CompletionRequest,
               limits: RequestLimits) -> ChatCompletionRequest | CompletionRequest:
    """body, if its prompt count and message count are within limits; else raises OpenAIError(400)."""
    if isinstance(body, CompletionRequest):
        prompts = 1 if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) \
            else len(body.prompt)
        if prompts > limits.max_batch_prompts:
            raise OpenAIError(400, f"prompt is a batch of {prompts} prompts; this server takes at most "
                                   f"{limits.max_batch_prompts} per request", param="prompt")
    elif len(body.messages) > limits.max_messages:
        raise OpenAIError(400, f"messages holds {len(body.messages)} messages; this server takes at most "
                               f"{limits.max_messages}", param="messages")
    return body


def parse_limited(cls: type[ChatCompletionRequest] | type[CompletionRequest], raw: bytes,
                  limits: RequestLimits) -> ChatCompletionRequest | CompletionRequest:
    """raw (a body read by read_body) decoded, validated as cls and checked against limits. Blocking. Raises
    OpenAIError(400)."""
    return check_body(parse_body(cls, decode_json(raw, limits.max_json_depth)), limits)
