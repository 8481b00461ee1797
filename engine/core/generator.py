"""One request at a time on the engine, as an iterator: the path behind `tandem generate`.

The Generator owns an LLMEngine sized for one request (KV for max_model_len tokens, no prefix cache), adds the
request, steps until it finishes and yields one GenerationStep per token, with timings. Leaving the iteration
early aborts the request, so its blocks are back in the pool at once.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from tandem.engine.core.llm_engine import LLMEngine, RequestRejectedError
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv.block_pool import BlockPool
from tandem.engine.loader.model_loader import LoadedModel
from tandem.engine.parallel import ParallelConfig
from tandem.engine.runner.executor import LocalExecutor
from tandem.engine.runner.model_runner import ModelRunner, SequenceChunk
from tandem.engine.sampling_params import SamplingParams

__all__ = ["GenerationResult", "GenerationStep", "Generator", "RequestRejectedError", "Timings"]


@dataclass(frozen=True)
class GenerationStep:
    token_id: int
    text: str  # the text this token completes ('' while a character or a possible stop string is incomplete)
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
    def __init__(self, loaded: LoadedModel, *, block_size: int = 16, max_model_len: int | None = None,
                 parallel: ParallelConfig = ParallelConfig(), kv_cache_dtype: str = "auto"):
        """parallel: split the model over processes (loaded may then hold no weights); close() stops them.
        kv_cache_dtype: engine_config.KV_CACHE_DTYPES."""
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        context = loaded.config.max_position_embeddings
        self.max_model_len = min(max_model_len or context, context)
        start = time.perf_counter()
        self.engine = LLMEngine(loaded, EngineConfig(
            block_size=block_size, num_kv_blocks=-(-self.max_model_len // block_size),
            max_model_len=self.max_model_len, max_num_batched_tokens=self.max_model_len, max_num_seqs=1,
            enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype), parallel=parallel)
        # Load time includes starting the ranks (and their loading their shards) for a multi-process replica.
        self.load_seconds = loaded.load_seconds + time.perf_counter() - start
        self.last_timings = Timings(load=self.load_seconds)
        self._ids = itertools.count()

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner (prompt_logits computes with it). Raises ValueError for a model split over
        rank processes."""
        if not isinstance(self.engine.executor, LocalExecutor):
            raise ValueError("the model runs in rank processes: no runner in this process")
        return self.engine.executor.runner

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def block_pool(self) -> BlockPool:
        return self.engine.kv_manager.pool

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[GenerationStep]:
        """Yields one step per generated token. Raises ValueError/RequestRejectedError before any work."""
        if params.n != 1:
            raise ValueError("the generator runs one sample (n=1); use the engine for n > 1")
        request_id = f"gen-{next(self._ids)}"
        self.engine.add_request(request_id, prompt_ids, params)
        timings = self.last_timings = Timings(load=self.load_seconds)
        start = time.perf_counter()
        try:
            while self.engine.has_unfinished_requests():
                step_start = time.perf_counter()
                outputs = self.engine.step()
                if not outputs:
                    continue  # a prefill chunk that does not reach the prompt's end
                if timings.ttft == 0.0:
                    timings.ttft = time.perf_counter() - start
                else:
                    timings.decode_steps += 1
                    timings.per_token += (time.perf_counter() - step_start - timings.per_token) / timings.decode_steps
                (output,) = outputs
                yield GenerationStep(output.token_ids[0], output.text, output.finish_reason)
        finally:
            self.engine.abort_request(request_id)

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
        self.engine.validate(prompt_ids, SamplingParams(max_tokens=1))
        blocks = self.block_pool.allocate(self.engine.kv_manager.blocks_for(len(prompt_ids)))
        try:
            return self.runner.execute([SequenceChunk(tuple(prompt_ids), 0, tuple(blocks))])[0]
        finally:
            for block in blocks:
                self.block_pool.decref(block, park=False)
