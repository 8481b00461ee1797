"""Per-request sampling settings, validated once where the request enters."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field

from tandem.engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 16  # proposals per sequence and step, at most (engine/decoding/speculation.py)
MAX_LORA_NAME = 128  # characters of a LoRA adapter's name


def _as_int(name: str, value: object) -> int:
    """value as a plain int (numpy integers included); bools and floats are rejected."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _as_float(name: str, value: object) -> float:
    """value as a finite float; NaN, infinities, bools and non-numbers are rejected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    n: completions to generate for the prompt. max_tokens: generated tokens at most (the prompt not counted).
    temperature: 0 means greedy (argmax). top_k: 0 or -1 disables it (stored as given). top_p: 1.0 disables it.
    min_p: 0.0 disables it. repetition_penalty (1.0 = off) applies to prompt and output tokens; presence and
    frequency penalties (0.0 = off) to output tokens only. seed: None lets the engine draw one per request.
    stop_token_ids / stop: token ids / strings that end the output (a single string is taken as one stop
    string; lists are stored as tuples). logprobs: None returns no log-probabilities; k in 0..20 returns the
    chosen token's log-probability plus the k most likely alternatives. structured: what the output must match
    (a JSON schema, regex, choice or grammar: engine/structured_output.py), or None. speculative_tokens: at most
    this many proposed tokens per step for this request on a replica that speculates (engine/decoding/speculation.py; 0
    turns it off for the request, None leaves it to the replica); the output is the same either way. lora: the name
    of the LoRA adapter to compute with (engine/models/lora.py), None for the base model; its KV is its own.

    Raises ValueError naming the field and its allowed range when a value is out of range or of the wrong type.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    speculative_tokens: int | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens", "top_k"):
            object.__setattr__(self, name, _as_int(name, getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", _as_int("seed", self.seed))
        for name in ("logprobs", "speculative_tokens"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _as_int(name, getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", self._stop_token_ids())
        object.__setattr__(self, "stop", self._stop_strings())
        self._check_ranges()

    def _stop_token_ids(self) -> tuple[int, ...]:
        ids = tuple(_as_int("stop_token_ids", t) for t in self.stop_token_ids)
        if (bad := next((t for t in ids if t < 0), None)) is not None:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad}")
        return ids

    def _stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stops:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got {s!r}")
            if not s:
                raise ValueError("stop strings must not be empty")
        return stops

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 to disable it, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if self.speculative_tokens is not None and not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] or None, "
                             f"got {self.speculative_tokens}")
        if self.lora is not None and (not isinstance(self.lora, str) or not 0 < len(self.lora) <= MAX_LORA_NAME):
            raise ValueError(f"lora must be an adapter name of 1..{MAX_LORA_NAME} characters, got {self.lora!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
            if self.ignore_eos:  # a finished grammar allows only the end of the sequence
                raise ValueError("ignore_eos cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        """top_k filters only when it is >= 1 (0 and -1 both mean off)."""
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError when a stop_token_id is not a token of a vocabulary of vocab_size ids."""
        if (bad := next((t for t in self.stop_token_ids if t >= vocab_size), None)) is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
