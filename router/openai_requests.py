"""OpenAI request bodies (router/openai_bodies.py) mapped onto tandem's gRPC pb.GenerateRequest, with no I/O:
chat_request for a chat body, completion_requests for a completion body (one request per prompt). Only the
sampling fields a body sets are set; the server applies its defaults to the rest and validates the ranges, as it
does for the gRPC API.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.openai_bodies import (ChatCompletionRequest, ChoiceOutput, CompletionRequest, GrammarOutput,
                                         JsonObjectFormat, JsonOutput, JsonSchemaResponseFormat, RegexOutput)
from tandem.router.openai_errors import OpenAIError
from tandem.router.tool_calls import call_schema


_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "speculative_tokens")


@contextmanager
def _encodable():
    """protobuf refuses text it cannot encode as UTF-8 (a lone surrogate from a JSON escape): that is a 400."""
    try:
        yield
    except ValueError as e:
        raise OpenAIError(400, f"the request holds text that cannot be encoded as UTF-8: {e}") from None


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> pb.StructuredOutput | None:
    """The constraint a body asks for (response_format on chat, or vLLM's structured_outputs), None for none."""
    mode = getattr(body, "tool_mode", None)
    if mode is not None and not mode.auto:  # tool_choice required or a named function: the reply is the call(s)
        return pb.StructuredOutput(json_schema=json.dumps(call_schema(body.tools, mode)))
    fmt = getattr(body, "response_format", None)
    if isinstance(fmt, JsonObjectFormat):
        return pb.StructuredOutput(json_object=True)
    if isinstance(fmt, JsonSchemaResponseFormat):
        schema = fmt.json_schema.schema_
        return pb.StructuredOutput(json_schema=json.dumps({} if schema is None else schema))
    wanted = body.structured_outputs
    if isinstance(wanted, JsonOutput):
        schema = wanted.json_
        return pb.StructuredOutput(json_schema=schema if isinstance(schema, str) else json.dumps(schema))
    if isinstance(wanted, RegexOutput):
        return pb.StructuredOutput(regex=wanted.regex)
    if isinstance(wanted, ChoiceOutput):
        return pb.StructuredOutput(choice=pb.Choices(choices=wanted.choice))
    if isinstance(wanted, GrammarOutput):
        return pb.StructuredOutput(grammar=wanted.grammar)
    return None


def _generate_request(body: ChatCompletionRequest | CompletionRequest, request_id: str, max_tokens: int | None,
                      logprobs: int | None, **prompt) -> pb.GenerateRequest:
    given = {name: getattr(body, name) for name in _SAMPLING_FIELDS} | {"max_tokens": max_tokens, "logprobs": logprobs}
    sampling = pb.SamplingParams(**{k: v for k, v in given.items() if v is not None}, ignore_eos=bool(body.ignore_eos),
                                 stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
                                 stop_token_ids=body.stop_token_ids or [], structured=structured_output(body))
    return pb.GenerateRequest(request_id=request_id, model=body.model, sampling=sampling, priority=body.priority or 0,
                              session_id=body.session_id or "", **prompt)


def _message_text(message) -> str:
    """A message's content; an assistant turn that only called tools shows the model its calls, as JSON."""
    if message.content:
        return message.content
    if message.tool_calls:
        return json.dumps([c.get("function", c) for c in message.tool_calls], ensure_ascii=False)
    return ""


def chat_request(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    """The chat prompt and the sampling fields the body sets (the others stay unset: the server applies defaults).
    max_completion_tokens wins over max_tokens; logprobs=true asks for top_logprobs alternatives (0 when unset).
    Raises OpenAIError(400) for text protobuf cannot encode."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    with _encodable():
        tools = [pb.Tool(name=t.function.name, description=t.function.description or "",
                         parameters_json="" if t.function.parameters is None else json.dumps(t.function.parameters))
                 for t in body.tools or ()]
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m.role, content=_message_text(m)) for m in body.messages],
                               tools=tools)
        return _generate_request(body, request_id, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                 chat=chat)


def completion_requests(body: CompletionRequest, request_id: str) -> list[pb.GenerateRequest]:
    """One request per prompt: a string or a flat list of token ids is one prompt, a list of either is several.
    With several, the i-th is f"{request_id}-{i}" and its choices are indices i*n .. i*n+n-1 of the reply (pass
    index_offset=i*n to ResponseBuilder). Raises OpenAIError(400) for text protobuf cannot encode."""
    prompts = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
    with _encodable():
        return [_generate_request(body, f"{request_id}-{i}" if len(prompts) > 1 else request_id, body.max_tokens,
                                  body.logprobs, **({"text": p} if isinstance(p, str) else {"token_ids": {"ids": p}}))
                for i, p in enumerate(prompts)]
