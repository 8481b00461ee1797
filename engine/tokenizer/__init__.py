"""Tokenization on the `tokenizers` library, chat templates on `jinja2`, and streaming detokenization."""

from tandem.engine.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
