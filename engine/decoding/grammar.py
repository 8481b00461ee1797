"""The grammar backend of structured output, on llguidance: compiles a StructuredOutput for one tokenizer, keeps a
matcher per sequence, and fills next-token masks for a whole batch at once.

The interface the engine uses, whatever the library behind it:
  GrammarBackend.compile(spec) -> Grammar        cached by spec (the backend is per tokenizer); raises
                                                 InvalidStructuredOutput with the compiler's message
  Grammar.matcher(tokens) -> Matcher             a fresh matcher that has accepted `tokens` (a resumed, migrated or
                                                 recomputed sequence replays its delivered output)
  Matcher.accept(token) / rollback(n) / copy() / is_terminated / accepts_end
  GrammarBackend.fill_masks_at(...)              one row of allowed tokens (bit t of word t // 32) per matcher,
                                                 computed in parallel in Rust with the GIL released, so it can run
                                                 on a thread while the forward pass runs

Torch-free (the router compiles a request's constraint to refuse a bad one before any replica sees it); the masks
as tensors and their application to logits live in engine/decoding/grammar_masks.py.

llguidance was chosen over xgrammar by measurement on the embedded model's vocabulary and the test suite's
constraints (bench/structured_output.py, docs/BENCHMARKS.md): it enforces every keyword it accepts (xgrammar
silently dropped five), its p99 mask and compile times were about 10x and 90x shorter, and it has no dependencies
(xgrammar requires torch, transformers and triton: too heavy for the router, which compiles every constraint).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from tandem.engine.structured_output import InvalidStructuredOutput, StructuredOutput

CACHE_SIZE = 256  # compiled grammars kept per backend (least recently used dropped)
# JSON as `json.dumps` writes it: ", " and ": " between items, no other whitespace. Free whitespace lets a small
# model spend its whole budget on blank lines (seen with the embedded model); a schema may override this in its
# "x-guidance" object (llguidance's JSON options).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for a spec (not yet checked: GrammarBackend.compile checks it)."""
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
    try:  # Lark as it is; GBNF/EBNF rules (`name ::= ...`, llama.cpp's and vLLM's format) converted to Lark
        text = any_to_lark(spec.value)
    except Exception as e:  # noqa: BLE001 - the converter's own errors are the user's grammar errors
        raise InvalidStructuredOutput(f"the grammar is neither Lark nor valid GBNF: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


class Matcher:
    """One sequence's position in its grammar. Not thread-safe: the engine uses it from one thread at a time
    (fill_masks runs on a helper thread while the engine thread waits on the forward pass, never on the matcher)."""

    def __init__(self, inner: llguidance.LLMatcher):
        self._inner = inner

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (and the matcher is in error from then on) if the grammar forbids it."""
        return self._inner.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted tokens (speculative tokens that were rejected)."""
        if not self._inner.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._inner.get_error()}")

    def copy(self) -> Matcher:
        """An independent matcher at the same position (n > 1 forks)."""
        return Matcher(self._inner.deep_copy())

    @property
    def is_terminated(self) -> bool:
        """The grammar allows nothing more (the end of output was accepted, or the matcher is in error)."""
        return self._inner.is_stopped() or self._inner.is_error()

    @property
    def accepts_end(self) -> bool:
        """The output so far is complete: the end-of-sequence token is allowed now."""
        return self._inner.is_accepting()

    @property
    def error(self) -> str | None:
        return self._inner.get_error() if self._inner.is_error() else None


class Grammar:
    """A compiled grammar; matcher() starts a sequence in it."""

    def __init__(self, spec: StructuredOutput, template: llguidance.LLMatcher):
        self.spec = spec
        self._template = template

    def matcher(self, tokens: Sequence[int] = ()) -> Matcher:
        """A matcher that has accepted `tokens`. Raises InvalidStructuredOutput if they do not fit the grammar."""
        inner = self._template.deep_copy()
        if tokens and not inner.consume_tokens(list(tokens)):
            raise InvalidStructuredOutput(f"the tokens delivered so far do not fit the {self.spec.describe()} "
                                          f"grammar: {inner.get_error()}")
        return Matcher(inner)


class GrammarBackend:
    """Compiles structured-output specs for one tokenizer and vocabulary. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int):
        """tokenizer: tandem's Tokenizer (engine/tokenizer: its `tokenizers` backend and end-of-sequence tokens,
        allowed where a grammar is complete); vocab_size: the logits' width (at least the tokenizer's). The
        token tables llguidance needs are built on the first compile (about 0.2 s for a 49k vocabulary), so an
        engine that never sees a structured request never pays for them."""
        self.vocab_size = vocab_size
        self._source = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[StructuredOutput, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses)

    def _tables(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                eos = sorted(self._source.eos_token_ids)
                self._tokenizer = llguidance.LLTokenizer(self._source.backend.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=eos or None)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> Grammar:
        """The compiled grammar of spec, from the cache when it was compiled before. Raises
        InvalidStructuredOutput with the compiler's message for a schema, regex or grammar it rejects."""
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._cache.move_to_end(spec)
                return found
        tables = self._tables()
        try:
            text = grammar_text(spec)
        except InvalidStructuredOutput:
            raise
        except ValueError as e:  # llguidance's converters refuse some specs outright (the JSON schema `false`)
            raise InvalidStructuredOutput(f"invalid {spec.kind}: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tables)
        if is_error:
            raise InvalidStructuredOutput(f"invalid {spec.kind}: {messages[0] if messages else 'rejected'}")
        template = llguidance.LLMatcher(tables, text, log_level=0)
        if template.is_error():
            raise InvalidStructuredOutput(f"invalid {spec.kind}: {template.get_error()}")
        grammar = Grammar(spec, template)
        with self._lock:
            self.compiles += 1
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def fill_masks_at(self, matchers: Sequence[tuple[Matcher, int]], address: int, row_bytes: int, rows: int) -> None:
        """Writes each (matcher, row) pair's allowed tokens (bit t of 32-bit word t // 32) into row `row` of the
        int32 [rows, row_bytes / 4] array at `address`, all in parallel without the GIL
        (engine/decoding/grammar_masks.py passes a tensor's memory)."""
        if matchers:
            self._tables()
            self._executor.unsafe_compute_mask_ptr([(m._inner, row) for m, row in matchers], address, row_bytes, rows)
