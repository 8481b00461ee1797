"""Engine outputs turned into OpenAI's reply bodies, with no I/O: ResponseBuilder makes the stream chunks or the
whole reply of /v1/chat/completions and /v1/completions, models_body the /v1/models list. Everything returned is a
plain dict, ready for JSON.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

from tandem.router.tool_calls import ToolMode, hermes_calls, tool_calls

if TYPE_CHECKING:
    from tandem.engine.core.output_processor import RequestOutput


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
    call_id: str | None = None  # a forced function call's id, streamed with its first arguments


class ResponseBuilder:
    """Turns one HTTP request's engine outputs into OpenAI's bodies: chunks() for a stream (then usage_chunk() when
    include_usage), or add() per batch of outputs and response() at the end.

    n: the reply's number of choices in all (n x prompts for a batched completion); a choice's index is
    index_offset + output.index. logprobs: whether choices carry logprobs. token_text: a token id's text, for the
    logprob entries; completions' text_offset counts the characters of those texts. finish_reason is passed on as
    the engine gives it, "abort" included (as vLLM does). tool_mode: a chat reply that is tool calls
    (router/tool_calls.py): a forced function's arguments stream as they come; required calls are sent whole when
    the reply ends (their names are known only then).
    """

    def __init__(self, kind: Literal["chat", "completion"], response_id: str, model: str, created: int,
                 token_text: Callable[[int], str], *, n: int, logprobs: bool, include_usage: bool = False,
                 tool_mode: ToolMode | None = None):
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', not {kind!r}")
        self.kind, self.response_id, self.model, self.created = kind, response_id, model, created
        self.token_text, self.n, self.logprobs, self.include_usage = token_text, n, logprobs, include_usage
        self.tool_mode = tool_mode if kind == "chat" else None
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
            elif self.tool_mode is not None:
                bodies += self._tool_chunks(body, choice, output)
            else:
                if not choice.started:
                    bodies.append({**body, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
                bodies.append({**body, "delta": {"content": output.text} if output.text or output.token_ids else {}})
            choice.started = True
        object_ = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        usage = {"usage": None} if self.include_usage else {}
        return [{**self._envelope(object_, [body]), **usage} for body in bodies]

    def _tool_chunks(self, body: dict, choice: _Choice, output: RequestOutput) -> list[dict]:
        """A tool-call choice's chunks for one output (see the class docstring)."""
        mode, out = self.tool_mode, []
        if mode.name is not None:  # a forced function: its arguments stream as they come
            if not choice.started:
                choice.call_id = f"call_{secrets.token_hex(12)}"
                call = {"index": 0, "id": choice.call_id, "type": "function",
                        "function": {"name": mode.name, "arguments": ""}}
                out.append({**body, "delta": {"role": "assistant", "content": None, "tool_calls": [call]},
                            "logprobs": None, "finish_reason": None})
            if output.text:
                out.append({**body, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": output.text}}]},
                            "finish_reason": None})
            if output.finish_reason:
                out.append({**body, "delta": {}, "logprobs": None})
            return out
        if not output.finish_reason:  # required calls, and auto replies: whole, at the end
            return [{**body, "delta": {}, "finish_reason": None}] if body["logprobs"] else []
        message, reason = self._final_message("".join(choice.text), output.finish_reason)
        if "tool_calls" in message:
            message = {**message, "tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}
        return [{**body, "delta": message, "finish_reason": None}, {**body, "delta": {}, "logprobs": None,
                                                                    "finish_reason": reason}]

    def _final_message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A finished chat choice's message and finish reason: its calls where the reply is tool calls, else its
        text (a reply cut short stays text, with its own finish reason)."""
        mode = self.tool_mode
        if mode is None or reason != "stop":
            return {"role": "assistant", "content": text}, reason
        if mode.auto:
            found = hermes_calls(text)
            if found is None:
                return {"role": "assistant", "content": text}, reason
            return {"role": "assistant", "content": found[0], "tool_calls": found[1]}, mode.finish_reason
        calls = tool_calls(mode, text)
        if calls is None:
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, mode.finish_reason

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
            if self.kind == "chat":
                message, reason = self._final_message(text, c.finish_reason)
                content = {"message": message}
            else:
                content, reason = {"text": text}, c.finish_reason
            choices.append({"index": index, **content, "logprobs": logprobs, "finish_reason": reason})
        object_ = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._envelope(object_, choices), "usage": _usage(prompt_tokens, completion_tokens, cached_tokens)}


def models_body(model_id: str, created: int, max_model_len: int, adapters: tuple[str, ...] = ()) -> dict:
    """The GET /v1/models body: the model the cluster serves, then each LoRA adapter served on it (its `parent`)."""
    base = {"object": "model", "created": created, "owned_by": "tandem", "max_model_len": max_model_len}
    return {"object": "list", "data": [{"id": model_id} | base] + [
        {"id": name} | base | {"root": name, "parent": model_id} for name in adapters]}
