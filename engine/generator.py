"""Single-process generation of one request at a time: the path behind `tandem generate`.

Flow of one request: allocate KV blocks for prompt + max_tokens, prefill the prompt in one chunk, then decode
one token per step, streaming text deltas; blocks are returned when the stream ends for any reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from tandem.engine.block_pool import BlockPool
from tandem.engine.errors import TandemError
from tandem.engine.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.loader import LoadedModel
from tandem.engine.model_runner import ModelRunner, SequenceChunk
from tandem.engine.sampler import make_generator, sample
from tandem.engine.sampling_params import SamplingParams


class RequestTooLongError(TandemError, ValueError):
    """prompt + max_tokens exceeds the context the generator was built for."""


@dataclass(frozen=True)
class GenerationStep:
    token_id: int
    text: str  # the text this token completes ('' while a multi-byte character is partial)
    finish_reason: str | None  # "stop" | "length" on the last step, else None


@dataclass
class Timings:
    """Seconds. per_token is the mean time of one decode step after the first token."""

    load: float = 0.0
    ttft: float = 0.0
    per_token: float = 0.0
    decode_steps: int = 0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    timings: Timings = field(default_factory=Timings)


class Generator:
    def __init__(self, loaded: LoadedModel, *, block_size: int = 16, max_model_len: int | None = None):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        config = loaded.config
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        num_blocks = -(-self.max_model_len // block_size)
        spec = KVCacheSpec(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                           loaded.model.dtype)
        self.block_pool = BlockPool(num_blocks)
        self.runner = ModelRunner(loaded.model, PagedKVCache(spec, loaded.model.device))
        self.block_size = block_size
        self.last_timings = Timings(load=loaded.load_seconds)

    def _check_fits(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        if (bad := next((t for t in prompt_ids if not 0 <= t < vocab), None)) is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[GenerationStep]:
        """Yields one step per generated token. Raises ValueError/RequestTooLongError before any work."""
        self._check_fits(prompt_ids, params)
        total = len(prompt_ids) + params.max_tokens
        blocks = tuple(self.block_pool.allocate(-(-total // self.block_size)))
        timings = Timings(load=self.loaded.load_seconds)
        self.last_timings = timings
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        detok = self.tokenizer.detokenizer()
        generator = make_generator(params, self.runner.device)
        try:
            start = time.perf_counter()
            logits = self.runner.execute([SequenceChunk(tuple(prompt_ids), 0, blocks)])
            computed = len(prompt_ids)
            for index in range(params.max_tokens):
                token = sample(logits[0], params, generator)
                now = time.perf_counter()
                if index == 0:
                    timings.ttft = now - start
                finish = "stop" if token in stop_ids else "length" if index + 1 == params.max_tokens else None
                yield GenerationStep(token, detok.step(token), finish)
                if finish:
                    break
                step_start = time.perf_counter()
                logits = self.runner.execute([SequenceChunk((token,), computed, blocks)])
                computed += 1
                timings.decode_steps += 1
                timings.per_token += (time.perf_counter() - step_start - timings.per_token) / timings.decode_steps
        finally:
            self.block_pool.free(list(blocks))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        steps = list(self.stream(prompt_ids, params))
        return GenerationResult(
            text="".join(s.text for s in steps),
            token_ids=[s.token_id for s in steps],
            prompt_token_ids=list(prompt_ids),
            finish_reason=steps[-1].finish_reason or "length",
            timings=self.last_timings,
        )

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [vocab] at the prompt's last position (the distribution of the first new token)."""
        self._check_fits(prompt_ids, SamplingParams(max_tokens=1))
        blocks = tuple(self.block_pool.allocate(-(-len(prompt_ids) // self.block_size)))
        try:
            return self.runner.execute([SequenceChunk(tuple(prompt_ids), 0, blocks)])[0]
        finally:
            self.block_pool.free(list(blocks))
