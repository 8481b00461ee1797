"""What a request asks its output to match: a JSON schema, any JSON object, a regex, one of fixed strings, or a
grammar. A plain, torch-free value carried by SamplingParams (the router builds it from the OpenAI fields); the
grammar backend (engine/decoding/grammar.py) compiles it.

Kinds and their `value`:
  json         a JSON schema, kept as compact JSON text (its keys in the client's order: properties are generated in
               that order), so equal schemas share one compiled grammar
  json_object  any JSON object (OpenAI's response_format {"type": "json_object"}); value is ""
  regex        a regular expression (Rust regex syntax, as llguidance reads it) the whole output must match
  choice       the output is exactly one of `choices`
  grammar      a context-free grammar: Lark (llguidance's dialect) or GBNF/EBNF (rules written `name ::= ...`)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused before compiling


class InvalidStructuredOutput(ValueError):
    """A structured-output request that cannot be served: a malformed field, or a schema, regex or grammar the
    compiler rejects (its message included). The API answers it with 400."""


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint. Build it with one of the class methods; raises InvalidStructuredOutput
    for a value of the wrong type or size."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidStructuredOutput(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise InvalidStructuredOutput(f"structured output {self.kind} must be a string, got {type(self.value).__name__}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidStructuredOutput(f"structured output {self.kind} is {len(self.value)} characters; at most "
                                          f"{MAX_SPEC_CHARS} are accepted")
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise InvalidStructuredOutput("choice needs a non-empty list of non-empty strings")
            if sum(map(len, self.choices)) > MAX_SPEC_CHARS:
                raise InvalidStructuredOutput(f"choice lists more than {MAX_SPEC_CHARS} characters")
        elif self.kind not in ("json_object",) and not self.value.strip():
            raise InvalidStructuredOutput(f"structured output {self.kind} is empty")

    @classmethod
    def json_schema(cls, schema: object) -> StructuredOutput:
        """schema: a dict (or bool) JSON schema, or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidStructuredOutput(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidStructuredOutput(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices) -> StructuredOutput:
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
            raise InvalidStructuredOutput("choice must be a list of strings")
        return cls("choice", "", tuple(choices))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        return cls("grammar", text)

    def describe(self) -> str:
        """A short label for logs and errors (never the whole schema)."""
        if self.kind == "choice":
            return f"choice of {len(self.choices)}"
        return self.kind if not self.value else f"{self.kind} ({len(self.value)} characters)"
