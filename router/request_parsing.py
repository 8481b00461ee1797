"""A gRPC GenerateRequest turned into what the replicas take (prompt token ids, SamplingParams, priority), with
every check the router can make before any replica is involved. InvalidRequest carries the gRPC status name and
a message for the client."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.tokenizer.chat_template import ChatTemplateError
from tandem.proto.v1 import tandem_pb2 as pb

DEFAULT_MAX_TOKENS = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# The sampling fields a request may leave unset (proto3 `optional`): unset ones take SamplingParams' defaults.
_OPTIONAL = tuple(f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence)


class InvalidRequest(ValueError):
    """code: the gRPC status name (INVALID_ARGUMENT, NOT_FOUND, ...)."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    session_id: str = ""
    cache_salt: str | None = None  # the tenant's prefix-cache salt (set by the server after authentication)


@dataclass(frozen=True)
class ModelFacts:
    """What the router knows about the served model (from its config and tokenizer)."""

    model_id: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int


def _prompt(request: pb.GenerateRequest, model: ModelFacts) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("the request has no prompt: set one of text, token_ids or chat")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("the prompt text is empty")
        return model.tokenizer.encode(request.text)
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids is empty")
        if (bad := next((t for t in ids if not 0 <= t < model.vocab_size), None)) is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{model.vocab_size - 1})")
        return ids
    messages = list(request.chat.messages)
    if not messages:
        raise InvalidRequest("chat has no messages")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"chat.messages[{i}].role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}")
    try:
        return model.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])
    except ChatTemplateError as e:
        raise InvalidRequest(f"chat messages cannot be rendered: {e}") from None


def parse_request(request: pb.GenerateRequest, model: ModelFacts) -> ParsedRequest:
    """Raises InvalidRequest for anything the cluster could not serve as asked."""
    if request.model and request.model != model.model_id:
        raise InvalidRequest(f"model {request.model!r} is not served here; this cluster serves {model.model_id!r}",
                             "NOT_FOUND")
    prompt = _prompt(request, model)
    s = request.sampling
    fields = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    fields.setdefault("max_tokens", max(1, min(DEFAULT_MAX_TOKENS, model.max_model_len - len(prompt))))
    try:
        params = SamplingParams(ignore_eos=s.ignore_eos, stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop),
                                **fields)
        params.check_vocab(model.vocab_size)
    except ValueError as e:
        raise InvalidRequest(f"sampling: {e}") from None
    total = len(prompt) + params.max_tokens
    if total > model.max_model_len:
        raise InvalidRequest(f"the prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                             f"the maximum context length {model.max_model_len}; shorten the prompt or lower "
                             f"max_tokens")
    if params.seed is None and not params.greedy:
        # Drawn here, not on a replica: the prefill replica samples the first token and the decode replica the
        # rest, and both must use the same seed for the output to be what one replica would produce.
        params = replace(params, seed=secrets.randbits(62))
    request_id = request.request_id or f"req-{secrets.token_hex(8)}"
    if len(request_id) > 128 or not request_id.isprintable() or "#" in request_id or "/" in request_id:
        raise InvalidRequest("request_id must be at most 128 printable characters without '#' or '/'")
    if len(request.session_id) > 256 or not request.session_id.isprintable():
        raise InvalidRequest("session_id must be at most 256 printable characters")
    return ParsedRequest(request_id, tuple(prompt), params, request.priority, request.session_id)
