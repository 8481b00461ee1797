"""Tool calling in the OpenAI API, on structured output: what a tool_choice constrains the reply to, and the reply
turned back into `tool_calls`. No I/O, no engine.

  tool_choice {"type": "function", "function": {"name": f}}   the reply is f's arguments: a JSON object matching
                                                               f's parameters schema; one call, finish_reason "stop"
                                                               (as OpenAI's forced calls)
  tool_choice "required"                                       the reply is a JSON array of {"name": one of the tools,
                                                               "arguments": that tool's parameters}, one call at least
                                                               (exactly one with parallel_tool_calls false);
                                                               finish_reason "tool_calls"
  tool_choice "none"                                           no call: free text (the tools still reach the chat
                                                               template, for templates that render them)
  tool_choice "auto" (OpenAI's default with tools)             free text, in which the model writes its calls in its
                                                               own format: taken for models whose chat template
                                                               renders `tools` and calls in Hermes' format
                                                               (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
                                                               Qwen 2.5/3 and Hermes models); the calls are parsed
                                                               from the finished reply (finish_reason "tool_calls"),
                                                               the rest is its content. Refused (400) for other
                                                               templates, the embedded model's included.

A reply cut by max_tokens (or a stop string) is not valid JSON: it stays text content, with its finish reason.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """How one chat request's reply becomes tool calls. name: the forced function (named), None for required and
    auto; auto: the model chooses (free text, Hermes-format calls parsed from it)."""

    name: str | None
    parallel: bool = True
    auto: bool = False

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"


def auto_supported(chat_template: str | None) -> bool:
    """Whether tool_choice auto can be served for a model with this chat template: it renders `tools` and writes
    calls in Hermes' format."""
    return bool(chat_template) and "tools" in chat_template and HERMES_OPEN in chat_template


def hermes_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(the content outside the calls, None if only whitespace; the calls) of an auto reply, or None when it
    holds no call or one whose JSON does not parse (the reply then stays text)."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        calls.append(_call(value["name"], value.get("arguments", {})))
    if not calls:
        return None
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def _parameters(function: Any) -> dict:
    return function.parameters if function.parameters is not None else {"type": "object"}


def call_schema(tools: list, mode: ToolMode) -> dict:
    """The JSON schema the reply must match. tools: the body's tool definitions (validated: the named one is among
    them)."""
    if mode.name is not None:
        return _parameters(next(t.function for t in tools if t.function.name == mode.name))
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t.function)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    return array | ({} if mode.parallel else {"maxItems": 1})


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def tool_calls(mode: ToolMode, text: str) -> list[dict] | None:
    """The reply's calls in OpenAI's shape, or None when the text is not a complete reply (cut short). For auto,
    use hermes_calls (a reply may mix content and calls)."""
    if mode.auto:
        found = hermes_calls(text)
        return None if found is None else found[1]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if mode.name is not None:
        return [_call(mode.name, value)]
    if not isinstance(value, list) or not all(isinstance(c, dict) and "name" in c for c in value):
        return None
    return [_call(c["name"], c.get("arguments", {})) for c in value]
