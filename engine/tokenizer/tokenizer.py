"""The tokenizer every tandem component shares, built from `tokenizer.json` or from GGUF metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from tandem.engine.errors import ModelLoadError
from tandem.engine.model_config import read_json_file
from tandem.engine.tokenizer.chat_template import ChatTemplateError, render_chat


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; a multi-byte character split across tokens is held back
    until it is complete, so every delta is valid UTF-8 and the deltas concatenate to decode(all ids)."""

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Feeds one id; returns the text it completes ('' while a character is still partial)."""
        return self._stream.step(self._backend, token_id) or ""


class Tokenizer:
    """Encode/decode, chat templates and stop ids of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids: Sequence[int] = ()):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids)
        if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None and eos_id not in ids:
            ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL while it tokenizes (encode holds it: a long prompt would stall every
        # other thread, such as the router's event loop, for the whole call).
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.backend, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Renders the model's own template (with `tools` for templates that render function definitions). Raises
        ChatTemplateError if the model has none or it fails."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a raw prompt instead")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           special_tokens={"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template uses `tools` (function definitions) at all."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation (the template writes any BOS itself, so none is added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Loads `tokenizer.json`, plus the chat template and special tokens of `tokenizer_config.json`
        (or `chat_template.jinja`). Raises ModelLoadError if tokenizer.json is missing or unreadable."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: tokenizer.json is missing (tandem needs the fast tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises bare Exceptions with its parse message
            raise ModelLoadError(f"{path}: cannot be read as a tokenizer: {e}") from None
        config = read_json_file(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(backend, chat_template=template, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), eos_token_ids=eos_token_ids)


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        return value.get("content")
    return value


__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
