"""The token the sampler drew for a sequence, with its log-probabilities. Torch-free: it crosses from the
runner to the scheduler, and from a prefill replica to a decode replica as the request's first token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampledToken:
    """token_id is the chosen token. When params.logprobs is not None, logprob is its log-probability under
    the model's raw distribution (log_softmax of the unprocessed logits) and top_logprobs holds the
    params.logprobs most likely (token_id, logprob) pairs of that distribution, highest first. Otherwise
    logprob is None; top_logprobs is () then and when params.logprobs == 0."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]
