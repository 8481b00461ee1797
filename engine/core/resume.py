"""Resuming a request that another replica was serving: the output tokens it already delivered, and the seed it
drew them with. Torch-free: the router builds one when a decode replica dies mid-stream (router/migration.py)
and hands it, through DecodeReplicaAPI.resume, to the engine of another replica (LLMEngine.add_request's
resume=...).

Why a replay equals the uninterrupted run: the sampler's draw depends only on (seed, step) (engine/decoding/sampler.py),
so a sequence that starts with these output tokens, draws with the same seed and counts its steps from
len(output_token_ids) samples the same next token; penalties and max_tokens count them as output tokens because
they are the sequence's outputs; and the output processor is primed with them (detokenizer and stop-string
matcher), so the next text delta is the one the first replica would have emitted next.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from tandem.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ResumeState:
    """output_token_ids: sample 0's tokens the client was already sent (may be empty: the first replica died
    before its first token reached the client; the replay then samples it again). seed: the seed sample 0 drew
    with; None: params.seed, or a fresh random seed when that is None too (the continuation of an unseeded
    sampled request then follows another random stream; greedy output does not depend on it).

    Raises ValueError for a token id that is not a non-negative integer."""

    output_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        try:
            ids = tuple(operator.index(t) for t in self.output_token_ids)
        except TypeError:
            raise ValueError(f"output_token_ids must be integers, got {self.output_token_ids!r}") from None
        if (bad := next((t for t in ids if t < 0), None)) is not None:
            raise ValueError(f"output_token_ids must be >= 0, got {bad}")
        object.__setattr__(self, "output_token_ids", ids)
        if self.seed is not None:
            object.__setattr__(self, "seed", operator.index(self.seed))

    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """Raises ValueError when the request cannot be resumed with params: n > 1 (samples of one request are
        not migrated), as many delivered tokens as max_tokens (the request had finished), or a token outside a
        vocabulary of vocab_size ids."""
        if params.n != 1:
            raise ValueError(f"only a request with n=1 can be resumed, got n={params.n}")
        if len(self.output_token_ids) >= params.max_tokens:
            raise ValueError(f"{len(self.output_token_ids)} delivered tokens already reach max_tokens "
                             f"({params.max_tokens}): the request had finished")
        if (bad := next((t for t in self.output_token_ids if t >= vocab_size), None)) is not None:
            raise ValueError(f"delivered token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
