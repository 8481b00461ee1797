"""Renders a model's own chat template (Jinja) the way Hugging Face does: sandboxed, trim/lstrip blocks."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.engine.errors import TandemError


class ChatTemplateError(TandemError, ValueError):
    """The template is missing, does not compile, or rejected the conversation (raise_exception)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def render_chat(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                special_tokens: Mapping[str, str | None], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """Returns the prompt text. tools: OpenAI-shaped function definitions, the template's `tools` (a template that
    does not use it renders as without). Raises ChatTemplateError on malformed messages or a template error."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ChatTemplateError(f"message {i} must be an object with 'role' and 'content'")
    try:
        return compile_template(source).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, tools=list(tools) if tools else None,
            **special_tokens
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None
