"""Runs the model over a batch: builds input tensors and attention metadata, returns logits or sampled tokens.

The runner owns no policy. Which tokens to compute and which KV blocks hold them arrive either as SequenceChunk
objects (execute: single-request generation, tests) or as a SchedulerOutput (execute_step: the engine). For the
engine it keeps a mirror of each scheduled sequence (tokens, block table, sampling settings) that the scheduler
updates with diffs, the split the scheduler/worker boundary will keep when ranks live in other processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.kv_cache import PagedKVCache
from tandem.engine.models import LlamaModel
from tandem.engine.sampler import SampleRequest, sample_batch
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class SequenceChunk:
    """token_ids: the tokens to compute now, at positions num_computed_tokens onwards.
    block_ids: the sequence's whole block table; it must cover num_computed_tokens + len(token_ids)."""

    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]


@dataclass
class _SeqState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int

    def sample_request(self) -> SampleRequest:
        step = len(self.token_ids) - self.num_prompt_tokens
        if not self.params.has_penalties:  # only penalties read the history: skip copying it every step
            return SampleRequest(self.params, self.seed, step, (), ())
        return SampleRequest(self.params, self.seed, step, self.token_ids[:self.num_prompt_tokens],
                             self.token_ids[self.num_prompt_tokens:])


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self._seqs: dict[str, _SeqState] = {}

    def execute(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Computes every chunk, writing its K/V to the cache. Returns float32 logits [len(chunks), vocab] of
        each chunk's last token. Raises ValueError if a block table is too short."""
        ids = [t for c in chunks for t in c.token_ids]
        positions = [p for c in chunks for p in range(c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids))]
        meta = AttentionMetadata.build(
            query_lens=[len(c.token_ids) for c in chunks],
            num_computed=[c.num_computed_tokens for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            block_size=self.kv_cache.spec.block_size,
            device=self.device,
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta,
            self.kv_cache,
        )
        last = torch.tensor(meta.query_start_loc[1:], device=self.device) - 1
        return self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def execute_step(self, output: SchedulerOutput) -> RunnerOutput:
        """Applies the scheduler's decisions (see scheduler_output.py for the order), runs one forward pass and
        samples. Raises KeyError if a cached sequence was never sent in full."""
        for seq_id in output.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        for new in output.new_seqs:
            self._seqs[new.seq_id] = _SeqState(list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                                               new.params, new.seed)
        for diff in output.cached_seqs:
            state = self._seqs[diff.seq_id]
            if diff.block_ids is not None:
                state.block_ids = list(diff.block_ids)
            else:
                state.block_ids.extend(diff.new_block_ids)
        if output.block_copies:
            self.kv_cache.copy_blocks(output.block_copies)
        if output.is_empty:
            return RunnerOutput()
        computed = {d.seq_id: d.num_computed_tokens for d in (*output.new_seqs, *output.cached_seqs)}
        chunks, to_sample = [], []
        for seq_id, count in output.num_scheduled_tokens.items():
            state = self._seqs[seq_id]
            start = computed[seq_id]
            chunks.append(SequenceChunk(tuple(state.token_ids[start:start + count]), start, tuple(state.block_ids)))
            if start + count == len(state.token_ids):
                to_sample.append(seq_id)
        logits = self.execute(chunks)
        row_of = {seq_id: i for i, seq_id in enumerate(output.num_scheduled_tokens)}
        rows, names = [], []
        for seq_id in to_sample:
            rows.append(row_of[seq_id])
            names.append(seq_id)
        for fork in output.forks:
            parent = self._seqs[fork.parent_id]
            self._seqs[fork.child_id] = _SeqState(list(parent.token_ids), parent.num_prompt_tokens,
                                                  list(parent.block_ids), parent.params, fork.seed)
            rows.append(row_of[fork.parent_id])
            names.append(fork.child_id)
        if not rows:
            return RunnerOutput()
        requests = [self._seqs[name].sample_request() for name in names]
        sampled = sample_batch(logits[torch.tensor(rows, device=logits.device)], requests)
        for name, token in zip(names, sampled):
            self._seqs[name].token_ids.append(token.token_id)
        return RunnerOutput(dict(zip(names, sampled)))
