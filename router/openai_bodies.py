"""The bodies of OpenAI's /v1/chat/completions and /v1/completions as pydantic models (ChatCompletionRequest,
CompletionRequest), and parse_body, which validates a decoded or raw JSON body into one of them or raises the
OpenAIError (400) a client of OpenAI's API would get.

Bodies take OpenAI's fields (response_format included) plus the vLLM extensions ignore_eos, top_k, min_p,
repetition_penalty, stop_token_ids, priority and structured_outputs, and tandem's session_id, timeout (seconds the
request may take, within the server's deadline) and speculative_tokens (engine/decoding/speculation.py). Fields OpenAI
defines that tandem cannot honour are refused ("X is not supported by tandem") unless they hold their default value; any
other unknown field is refused with OpenAI's wording. Only types are checked here: numeric ranges are the server's to
validate, like every sampling parameter.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.router.openai_errors import OpenAIError
from tandem.router.request_parsing import CHAT_ROLES
from tandem.router.tool_calls import ToolMode

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

    UNSUPPORTED = {"function_call": (None,), "audio": (None,), "refusal": (None,)}
    role: str
    content: str | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls: the model sees them as their JSON
    tool_call_id: str | None = None  # a tool message's answer to that call: the model sees its content

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


class JsonSchemaFormat(_Body):
    """response_format.json_schema: the schema the reply's content must match (always enforced, strict or not)."""

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema.
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class JsonOutput(_Body):
    json_: dict[str, Any] | bool | str = Field(alias="json")  # a schema, as an object or as JSON text


class RegexOutput(_Body):
    regex: str


class ChoiceOutput(_Body):
    choice: list[str]


class GrammarOutput(_Body):
    grammar: str  # Lark, or GBNF/EBNF


# vLLM's structured_outputs extension: exactly one of json, regex, choice or grammar.
StructuredOutputs = JsonOutput | RegexOutput | ChoiceOutput | GrammarOutput


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: any object
    strict: bool | None = None  # calls always match the parameters, strict or not


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


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
    timeout: float | None = Field(None, gt=0)  # seconds; the server's request_timeout_s caps it
    structured_outputs: StructuredOutputs | None = None
    # tandem's: at most this many speculated tokens per step for this request (0: none); the output is the same.
    speculative_tokens: Int32 | None = None

    @model_validator(mode="before")
    @classmethod
    def _constraint_shapes(cls, data: Any) -> Any:
        """Clear messages for the two constraint fields, ahead of pydantic's union errors."""
        if not isinstance(data, dict):
            return data
        wanted = data.get("structured_outputs")
        if isinstance(wanted, dict) and (len(wanted) != 1 or not set(wanted) <= {"json", "regex", "choice", "grammar"}):
            raise _invalid("combination", "structured_outputs takes exactly one of json, regex, choice or grammar",
                           param="structured_outputs")
        fmt = data.get("response_format")
        if isinstance(fmt, dict):
            if fmt.get("type") not in ("text", "json_object", "json_schema"):
                raise _invalid("combination", f"response_format.type {fmt.get('type')!r} is not one of text, "
                               "json_object, json_schema", param="response_format.type")
            if fmt["type"] == "json_schema" and "json_schema" not in fmt:
                raise _invalid("combination", "response_format.json_schema is required with type json_schema",
                               param="response_format.json_schema")
        return data

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
    UNSUPPORTED = {"functions": (None, []), "function_call": (None, "none"), "logit_bias": (None, {}),
                   "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,)}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        constraints = [name for name, given in (
            ("response_format", self.response_format is not None and not isinstance(self.response_format, TextFormat)),
            ("structured_outputs", self.structured_outputs is not None),
            ("tool_choice", self.tool_mode is not None and not self.tool_mode.auto)) if given]
        if len(constraints) > 1:
            raise _invalid("combination", f"give one of {' and '.join(constraints)}, not both",
                           param=constraints[-1])
        return self

    @model_validator(mode="after")
    def _tool_choice_fits_the_tools(self):
        choice, names = self.tool_choice, [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise _invalid("combination", "tools must have distinct function names", param="tools")
        if choice in (None, "none"):
            return self
        if not names:
            raise _invalid("combination", "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _invalid("combination", f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        return self

    @property
    def tool_mode(self) -> ToolMode | None:
        """How the reply becomes tool calls (router/tool_calls.py), None for a free-text reply."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolMode(self.tool_choice.function.name)
        if self.tool_choice == "required":
            return ToolMode(None, parallel=self.parallel_tool_calls is not False)
        if self.tools and self.tool_choice in (None, "auto"):  # OpenAI's default with tools is auto
            return ToolMode(None, parallel=self.parallel_tool_calls is not False, auto=True)
        return None

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
