"""A gRPC GenerateRequest turned into what the replicas take (prompt token ids, SamplingParams, priority), with
every check the router can make before any replica is involved. InvalidRequest carries the gRPC status name and
a message for the client.

The request limits (router/limits.py RequestLimits) are checked in the cheapest order: sizes the client states
(n, max_tokens, stop strings, logprobs, messages, prompt characters) before the prompt is tokenized, its tokens
after. parse_request is pure and blocking (tokenizing, chat templates): the front doors run it off the event
loop (serving.py)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace

from tandem.engine.decoding.grammar import GrammarBackend
from tandem.engine.kv.prefix_cache import kv_salt
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import InvalidStructuredOutput, StructuredOutput
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.tokenizer.chat_template import ChatTemplateError
from tandem.router.lora_routes import LoRARoutes
from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.limits import RequestLimits

DEFAULT_MAX_TOKENS = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# The sampling fields a request may leave unset (proto3 `optional`): unset ones take SamplingParams' defaults.
# (`structured`, a message, has presence too: it is converted on its own.)
_OPTIONAL = tuple(f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence and f.message_type is None)


class InvalidRequest(ValueError):
    """code: the gRPC status name (INVALID_ARGUMENT, NOT_FOUND, ...). structured_output: the request's
    structured-output constraint is what was refused (counted in tandem_structured_output_requests)."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT", *, structured_output: bool = False):
        super().__init__(message)
        self.code = code
        self.structured_output = structured_output


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    session_id: str = ""
    cache_salt: str | None = None  # the tenant's prefix-cache salt (set by the server after authentication)
    tenant: str | None = None  # who sent it (None: authentication is off); ids are scoped by it
    trace: str | None = None  # the W3C traceparent of the router's span for it (router/tracing.py); None: untraced

    @property
    def hash_salt(self) -> str | None:
        """What the replicas' block hashes of this request include: the tenant's salt and its LoRA adapter."""
        return kv_salt(self.cache_salt, self.params.lora)


@dataclass(frozen=True)
class ModelFacts:
    """What the router knows about the served model (from its config and tokenizer). grammars compiles a
    request's structured-output constraint, so that a bad one is refused before any replica sees it (built from
    the tokenizer when not given; its token tables only on the first constrained request)."""

    model_id: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    grammars: GrammarBackend | None = field(default=None, compare=False)
    lora: LoRARoutes | None = field(default=None, compare=False)  # the LoRA adapters served beside the model

    def __post_init__(self) -> None:
        if self.grammars is None and self.tokenizer is not None:
            object.__setattr__(self, "grammars", GrammarBackend(self.tokenizer, self.vocab_size))


def _check_chars(chars: int, limit: int) -> None:
    if chars > limit:
        raise InvalidRequest(f"the prompt has {chars} characters; this server takes at most {limit} "
                             f"(router.limits.max_prompt_chars)")


def _prompt(request: pb.GenerateRequest, model: ModelFacts, limits: RequestLimits) -> list[int]:
    kind = request.WhichOneof("prompt")
    max_tokens = limits.prompt_tokens(model.max_model_len)
    if kind is None:
        raise InvalidRequest("the request has no prompt: set one of text, token_ids or chat")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("the prompt text is empty")
        _check_chars(len(request.text), limits.prompt_chars(model.max_model_len))
        ids = model.tokenizer.encode(request.text)
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids is empty")
        if len(ids) > max_tokens:  # before the vocabulary scan
            raise _too_many_tokens(len(ids), max_tokens, model)
        if (bad := next((t for t in ids if not 0 <= t < model.vocab_size), None)) is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{model.vocab_size - 1})")
    else:
        ids = _chat_prompt(list(request.chat.messages), model, limits, list(request.chat.tools))
    if len(ids) > max_tokens:
        raise _too_many_tokens(len(ids), max_tokens, model)
    return ids


def _too_many_tokens(count: int, cap: int, model: ModelFacts) -> InvalidRequest:
    why = "the maximum context length" if cap == model.max_model_len else "router.limits.max_prompt_tokens"
    return InvalidRequest(f"the prompt has {count} tokens; this server takes at most {cap} ({why})")


def _tool_definitions(tools: list[pb.Tool]) -> list[dict]:
    """The tools as OpenAI shapes them, for chat templates that render them."""
    out = []
    for t in tools:
        try:
            parameters = json.loads(t.parameters_json) if t.parameters_json else {"type": "object"}
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"tool {t.name!r}: parameters are not valid JSON: {e}") from None
        out.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": parameters}})
    return out


def _chat_prompt(messages: list[pb.ChatMessage], model: ModelFacts, limits: RequestLimits,
                 tools: list[pb.Tool] = ()) -> list[int]:
    if not messages:
        raise InvalidRequest("chat has no messages")
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"chat has {len(messages)} messages; this server takes at most {limits.max_messages}")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"chat.messages[{i}].role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}")
    tool_chars = sum(len(t.name) + len(t.description) + len(t.parameters_json) for t in tools)
    _check_chars(sum(len(m.content) for m in messages) + tool_chars, limits.prompt_chars(model.max_model_len))
    try:
        return model.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages],
                                           tools=_tool_definitions(tools) or None)
    except ChatTemplateError as e:
        raise InvalidRequest(f"chat messages cannot be rendered: {e}") from None


def _check_sampling(s: pb.SamplingParams, model: ModelFacts, limits: RequestLimits) -> None:
    """The sizes a client states, checked before anything is built from them."""
    if s.HasField("n") and s.n > limits.max_n:
        raise InvalidRequest(f"n={s.n} is more than this server allows ({limits.max_n})")
    if s.HasField("max_tokens") and s.max_tokens > (cap := limits.completion_tokens(model.max_model_len)):
        why = "the maximum context length" if cap == model.max_model_len else "router.limits.max_tokens"
        raise InvalidRequest(f"max_tokens={s.max_tokens} is more than this server allows: {cap} ({why})")
    if s.HasField("logprobs") and s.logprobs > limits.max_top_logprobs:
        raise InvalidRequest(f"logprobs={s.logprobs} asks for more alternatives than this server gives "
                             f"({limits.max_top_logprobs})")
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"{len(s.stop)} stop strings; this server takes at most {limits.max_stop_strings}")
    if (long := next((x for x in s.stop if len(x) > limits.max_stop_string_chars), None)) is not None:
        raise InvalidRequest(f"a stop string of {len(long)} characters; this server takes at most "
                             f"{limits.max_stop_string_chars}")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(f"{len(s.stop_token_ids)} stop_token_ids; this server takes at most "
                             f"{limits.max_stop_token_ids}")


def parse_request(request: pb.GenerateRequest, model: ModelFacts,
                  limits: RequestLimits = RequestLimits()) -> ParsedRequest:
    """Raises InvalidRequest for anything the cluster could not serve as asked or that exceeds limits. Blocking
    (tokenizes the prompt): run it off an event loop."""
    adapter = None
    if request.model and request.model != model.model_id:
        if model.lora is None or not model.lora.serves(request.model):
            names = model.lora.names if model.lora is not None else ()
            adapters = f" and the LoRA adapters {', '.join(names)}" if names else ""
            raise InvalidRequest(f"model {request.model!r} is not served here; this cluster serves "
                                 f"{model.model_id!r}{adapters}", "NOT_FOUND")
        adapter = request.model
    s = request.sampling
    _check_sampling(s, model, limits)
    _check_ids(request)
    prompt = _prompt(request, model, limits)
    fields = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    fields.setdefault("max_tokens", max(1, min(DEFAULT_MAX_TOKENS, limits.completion_tokens(model.max_model_len),
                                               model.max_model_len - len(prompt))))
    structured = _structured(s, model)
    try:
        params = SamplingParams(ignore_eos=s.ignore_eos, stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop),
                                structured=structured, lora=adapter, **fields)
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
    return ParsedRequest(request_id, tuple(prompt), params, request.priority, request.session_id)


def engine_constraint(s: pb.StructuredOutput) -> StructuredOutput | None:
    """The proto's constraint as the engine's value; None when no kind is set. Raises InvalidStructuredOutput for
    a malformed one."""
    kind = s.WhichOneof("kind")
    if kind == "json_schema":
        return StructuredOutput.json_schema(s.json_schema)
    if kind == "json_object":
        return StructuredOutput.json_object() if s.json_object else None
    if kind == "regex":
        return StructuredOutput.regex(s.regex)
    if kind == "choice":
        return StructuredOutput.choice(list(s.choice.choices))
    if kind == "grammar":
        return StructuredOutput.grammar(s.grammar)
    return None


def _structured(s: pb.SamplingParams, model: ModelFacts) -> StructuredOutput | None:
    """The request's constraint, compiled once here so that a schema, regex or grammar the compiler rejects is an
    INVALID_ARGUMENT with its message (the replica's compile is then a cache hit of its own backend)."""
    if not s.HasField("structured"):
        return None
    try:
        spec = engine_constraint(s.structured)
        if spec is not None and model.grammars is not None:
            model.grammars.compile(spec)
    except InvalidStructuredOutput as e:
        raise InvalidRequest(f"structured output: {e}", structured_output=True) from None
    return spec


def _check_ids(request: pb.GenerateRequest) -> None:
    rid = request.request_id
    if len(rid) > 128 or not rid.isprintable() or "#" in rid or "/" in rid:
        raise InvalidRequest("request_id must be at most 128 printable characters without '#' or '/'")
    if len(request.session_id) > 256 or not request.session_id.isprintable():
        raise InvalidRequest("session_id must be at most 256 printable characters")
