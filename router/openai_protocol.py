"""OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models) translated to and from tandem's gRPC
request, with no I/O: parse_body validates a body into ChatCompletionRequest / CompletionRequest, chat_request and
completion_requests map it onto pb.GenerateRequest, and ResponseBuilder turns engine outputs into OpenAI's reply
bodies and stream chunks (plain dicts, ready for JSON).

Bodies take OpenAI's fields plus the vLLM extensions ignore_eos, top_k, min_p, repetition_penalty, stop_token_ids
and priority, and tandem's session_id. Fields OpenAI defines that tandem cannot honour are refused ("X is not
supported by tandem") unless they hold their default value; any other unknown field is refused with OpenAI's
wording. Only types are checked here: numeric ranges are the server's to validate, like every sampling parameter.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.request_parsing import CHAT_ROLES

if TYPE_CHECKING:
    from tandem.engine.output_processor import RequestOutput


class OpenAIError(Exception):
    """An error reply: HTTP `status` and, from body(), OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_HTTP_FOR_GRPC = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"), "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"), "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"), "NOT_FOUND": (404, "invalid_request_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"), "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "request_cancelled"), "UNIMPLEMENTED": (501, "not_implemented_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"), "DEADLINE_EXCEEDED": (504, "timeout_error"),
}


def http_status_for(grpc_code_name: str) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for a gRPC status name such as "NOT_FOUND":

    INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE -> 400 invalid_request_error
    UNAUTHENTICATED -> 401 authentication_error      PERMISSION_DENIED -> 403 permission_error
    NOT_FOUND -> 404 invalid_request_error           ALREADY_EXISTS -> 409 invalid_request_error
    RESOURCE_EXHAUSTED -> 429 rate_limit_error       CANCELLED -> 499 request_cancelled
    UNIMPLEMENTED -> 501 not_implemented_error       UNAVAILABLE -> 503 service_unavailable_error
    DEADLINE_EXCEEDED -> 504 timeout_error           INTERNAL and any other name -> 500 internal_error
    """
    return _HTTP_FOR_GRPC.get(grpc_code_name, (500, "internal_error"))


# --- request bodies ------------------------------------------------------------------------------------------------

Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]  # the proto's integer widths: larger values cannot be sent
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]


def _invalid(kind: str, message: str, **ctx) -> PydanticCustomError:
    return PydanticCustomError(kind, "{message}", {"message": message, **ctx})


class _Body(BaseModel):
    """Strict JSON types (no "1" for 1, no NaN), unknown fields refused. UNSUPPORTED: the fields OpenAI defines
    that tandem cannot honour, each with the values that ask for nothing (the defaults); they are dropped."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, defaults in cls.UNSUPPORTED.items():
            if name in data and not any(data[name] == d and type(data[name]) is type(d) for d in defaults):
                raise _invalid("unsupported", f"{name} is not supported by tandem", name=name)
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED}


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; tandem sends no obfuscation padding either way


class ChatMessage(_Body):
    """content: a string, or a list of {"type": "text", "text": ...} parts, joined with "\\n" (as vLLM does);
    null only in assistant messages. name is accepted and has no effect."""

    UNSUPPORTED = {"tool_calls": (None, []), "tool_call_id": (None,), "function_call": (None,), "audio": (None,),
                   "refusal": (None,)}
    role: str
    content: str | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise _invalid("role", f"{role!r} is not one of {', '.join(sorted(CHAT_ROLES))}")
        return role

    @field_validator("content", mode="plain")
    @classmethod
    def _content_text(cls, content: Any, info: ValidationInfo) -> str | None:
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise _invalid("content", "required (it may be null only in assistant messages)")
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise _invalid("content", "must be a string or a list of content parts")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise _invalid("content", f"part {j} has type {kind!r}, which is not supported by tandem "
                                          "(only 'text' parts are)")
            if not isinstance(part.get("text"), str):
                raise _invalid("content", f"part {j} has no string 'text'")
        return "\n".join(part["text"] for part in content)


class _Request(_Body):
    """The fields both endpoints share. user is accepted and has no effect; priority: lower runs first."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int32 | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int32] | None = None
    priority: Int32 | None = None
    session_id: str | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop_strings(cls, stop: Any) -> str | list[str] | None:
        if stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            return stop
        raise _invalid("stop", "must be a string or a list of strings")

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _invalid("combination", "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           param="stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed reply ends with a usage chunk (stream_options.include_usage)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Request):
    UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                   "function_call": (None, "none"), "parallel_tool_calls": (None, True),
                   "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "audio": (None,),
                   "modalities": (None, ["text"]), "prediction": (None,)}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("combination", "top_logprobs requires logprobs to be true", param="top_logprobs")
        return self


class CompletionRequest(_Request):
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of token ids. logprobs: the
    chosen token's logprob plus this many alternatives. best_of may only be 1 or n (tandem returns every sample)."""

    UNSUPPORTED = {"logit_bias": (None, {}), "echo": (None, False), "suffix": (None, "")}
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Int32 | None = None
    best_of: Int32 | None = None

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of not in (None, 1, self.n or 1):
            raise _invalid("combination", "best_of is not supported by tandem (other than 1 or n)", param="best_of")
        return self

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> str | list:
        def token_ids(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int and 0 <= t < 2**31 for t in x)

        if prompt == []:
            raise _invalid("prompt", "must not be an empty list")
        if isinstance(prompt, str) or token_ids(prompt) or (isinstance(prompt, list) and (
                all(isinstance(p, str) for p in prompt) or all(token_ids(p) for p in prompt))):
            return prompt
        raise _invalid("prompt", "must be a string, a list of strings, a list of token ids (non-negative "
                       "integers) or a list of lists of token ids")


RequestBody = TypeVar("RequestBody", ChatCompletionRequest, CompletionRequest)


def _path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _openai_error(e: ValidationError) -> OpenAIError:
    err = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")[0]  # unknown fields first
    path, ctx = _path(err["loc"]), err.get("ctx") or {}
    if err["type"] == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {path}", param=path)
    if err["type"] == "unsupported":
        param = f"{path}.{ctx['name']}" if path else ctx["name"]
        return OpenAIError(400, f"{param} is not supported by tandem", param=param)
    if err["type"] == "combination":
        return OpenAIError(400, err["msg"], param=ctx["param"])
    return OpenAIError(400, f"{path}: {err['msg']}" if path else err["msg"], param=path or None)


def parse_body(model_cls: type[RequestBody], data: Any) -> RequestBody:
    """data: the decoded JSON body, or the raw body as bytes. Raises OpenAIError (400, invalid_request_error) when
    it is not a JSON object or any field is unknown, unsupported or of the wrong type; param names the first bad
    field (e.g. "messages[1].content")."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = json.loads(data)
        except ValueError:
            raise OpenAIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise _openai_error(e) from None


# --- request bodies -> pb.GenerateRequest --------------------------------------------------------------------------


_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed")


@contextmanager
def _encodable():
    """protobuf refuses text it cannot encode as UTF-8 (a lone surrogate from a JSON escape): that is a 400."""
    try:
        yield
    except ValueError as e:
        raise OpenAIError(400, f"the request holds text that cannot be encoded as UTF-8: {e}") from None


def _generate_request(body: _Request, request_id: str, max_tokens: int | None, logprobs: int | None,
                      **prompt) -> pb.GenerateRequest:
    given = {name: getattr(body, name) for name in _SAMPLING_FIELDS} | {"max_tokens": max_tokens, "logprobs": logprobs}
    sampling = pb.SamplingParams(**{k: v for k, v in given.items() if v is not None}, ignore_eos=bool(body.ignore_eos),
                                 stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
                                 stop_token_ids=body.stop_token_ids or [])
    return pb.GenerateRequest(request_id=request_id, model=body.model, sampling=sampling, priority=body.priority or 0,
                              session_id=body.session_id or "", **prompt)


def chat_request(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    """The chat prompt and the sampling fields the body sets (the others stay unset: the server applies defaults).
    max_completion_tokens wins over max_tokens; logprobs=true asks for top_logprobs alternatives (0 when unset).
    Raises OpenAIError(400) for text protobuf cannot encode."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    with _encodable():
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m.role, content=m.content or "") for m in body.messages])
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


# --- engine outputs -> reply bodies --------------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


_COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@dataclass
class _Choice:
    """What one choice has produced so far. logprobs: the lists of OpenAI's logprobs object, by key."""

    text: list[str] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=dict)
    token_chars: int = 0  # characters of token text so far: the next token's text_offset (completions)
    finish_reason: str | None = None
    started: bool = False


class ResponseBuilder:
    """Turns one HTTP request's engine outputs into OpenAI's bodies: chunks() for a stream (then usage_chunk() when
    include_usage), or add() per batch of outputs and response() at the end.

    n: the reply's number of choices in all (n x prompts for a batched completion); a choice's index is
    index_offset + output.index. logprobs: whether choices carry logprobs. token_text: a token id's text, for the
    logprob entries; completions' text_offset counts the characters of those texts. finish_reason is passed on as
    the engine gives it, "abort" included (as vLLM does).
    """

    def __init__(self, kind: Literal["chat", "completion"], response_id: str, model: str, created: int,
                 token_text: Callable[[int], str], *, n: int, logprobs: bool, include_usage: bool = False):
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', not {kind!r}")
        self.kind, self.response_id, self.model, self.created = kind, response_id, model, created
        self.token_text, self.n, self.logprobs, self.include_usage = token_text, n, logprobs, include_usage
        self._choices: dict[int, _Choice] = {}

    def _envelope(self, object_: str, choices: list[dict]) -> dict:
        return {"id": self.response_id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _take(self, output: RequestOutput, index_offset: int) -> tuple[int, _Choice, dict | None]:
        """Records an output in its choice; returns the choice index, its state and this output's logprobs."""
        index = index_offset + output.index
        if not 0 <= index < self.n:
            raise ValueError(f"choice index {index} is outside 0..{self.n - 1}")
        choice = self._choices.setdefault(index, _Choice())
        choice.text.append(output.text)
        choice.finish_reason = output.finish_reason or choice.finish_reason
        if not self.logprobs or not output.logprobs:
            return index, choice, None
        if self.kind == "chat":
            piece = {"content": [{**self._token(lp.token_id, lp.logprob),
                                  "top_logprobs": [self._token(t, p) for t, p in lp.top_logprobs]}
                                 for lp in output.logprobs]}
        else:
            piece = {key: [] for key in _COMPLETION_LOGPROBS}
            for lp in output.logprobs:
                piece["tokens"].append(self.token_text(lp.token_id))
                piece["token_logprobs"].append(lp.logprob)
                piece["top_logprobs"].append({self.token_text(t): p for t, p in lp.top_logprobs})
                piece["text_offset"].append(choice.token_chars)
                choice.token_chars += len(piece["tokens"][-1])
        for key, values in piece.items():
            choice.logprobs.setdefault(key, []).extend(values)
        return index, choice, piece

    def chunks(self, outputs: list[RequestOutput], index_offset: int = 0) -> list[dict]:
        """The stream chunks for these outputs, in order; none for an output without text, tokens or finish
        reason. A chat choice's first chunk is {"role": "assistant", "content": ""}, sent just before its first
        content. With include_usage, every chunk has "usage": None. Raises ValueError for a choice index >= n."""
        bodies = []
        for output in outputs:
            if not (output.text or output.token_ids or output.finish_reason):
                continue
            index, choice, logprobs = self._take(output, index_offset)
            body = {"index": index, "logprobs": logprobs, "finish_reason": output.finish_reason}
            if self.kind == "completion":
                bodies.append({**body, "text": output.text})
            else:
                if not choice.started:
                    bodies.append({**body, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
                bodies.append({**body, "delta": {"content": output.text} if output.text or output.token_ids else {}})
            choice.started = True
        object_ = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        usage = {"usage": None} if self.include_usage else {}
        return [{**self._envelope(object_, [body]), **usage} for body in bodies]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        """The stream's last chunk when include_usage: no choices, the request's usage (over every choice)."""
        object_ = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(object_, []), "usage": _usage(prompt_tokens, completion_tokens, cached_tokens)}

    def add(self, outputs: list[RequestOutput], index_offset: int = 0) -> None:
        """Accumulates outputs for response(). Raises ValueError for a choice index >= n."""
        for output in outputs:
            self._take(output, index_offset)

    def response(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        """The whole reply, choices by index. Raises ValueError unless every one of the n choices has finished."""
        unfinished = [i for i in range(self.n) if i not in self._choices or not self._choices[i].finish_reason]
        if unfinished:
            raise ValueError(f"choices {unfinished} have not finished; call response() once all {self.n} have")
        keys = ("content",) if self.kind == "chat" else _COMPLETION_LOGPROBS
        choices = []
        for index, c in sorted(self._choices.items()):
            text, logprobs = "".join(c.text), {k: c.logprobs.get(k, []) for k in keys} if self.logprobs else None
            content = {"message": {"role": "assistant", "content": text}} if self.kind == "chat" else {"text": text}
            choices.append({"index": index, **content, "logprobs": logprobs, "finish_reason": c.finish_reason})
        object_ = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._envelope(object_, choices), "usage": _usage(prompt_tokens, completion_tokens, cached_tokens)}


def models_body(model_id: str, created: int, max_model_len: int) -> dict:
    """The GET /v1/models body: the one model the cluster serves."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "tandem",
                                        "max_model_len": max_model_len}]}
