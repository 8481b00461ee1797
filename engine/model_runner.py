"""Runs the model over a batch: builds input tensors and attention metadata, returns logits or sampled tokens.

The runner owns no policy. Which tokens to compute and which KV blocks hold them arrive either as SequenceChunk
objects (execute: single-request generation, tests) or as a SchedulerOutput (execute_step: the engine). For the
engine it keeps a mirror of each scheduled sequence (tokens, block table, sampling settings) that the scheduler
updates with diffs, the split the scheduler/worker boundary keeps when ranks live in other processes.

In a replica of several ranks (engine/ranks/) every rank runs a ModelRunner on the same SchedulerOutput. Only
the sampler rank (the last stage's first) computes logits and samples; the others learn the sampled tokens with
the next step (execute_step's `prev_tokens`). With pipeline stages a step's sequences are cut into micro-batches:
a stage sends micro-batch i on and starts i + 1 while the next stage works on i.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.kv_cache import PagedKVCache
from tandem.engine.models import LlamaModel
from tandem.engine.models.step import run_step
from tandem.engine.rejection_sampler import accept_drawn
from tandem.engine.sampler import SampleRequest, sample_batch
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tandem.engine.grammar import GrammarBackend, Matcher
    from tandem.engine.grammar_masks import MaskJob
    from tandem.engine.models.compiled import CompiledDecode
    from tandem.engine.models.cuda_graphs import CudaGraphDecode
    from tandem.engine.parallel.comm import ParallelComm


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
    matcher: Matcher | None = None  # the sequence's place in its grammar (structured output), on a sampling rank

    def sample_request(self, proposed: Sequence[int] = ()) -> SampleRequest:
        """The sampler's row for the sequence's next token, or, with proposed tokens, for the token after them."""
        return SampleRequest.after(self.params, self.seed, self.token_ids, self.num_prompt_tokens, proposed)


@dataclass
class RunnerTimes:
    """Seconds since start: whole steps, and the model's forward passes inside them (a pipeline stage's idle
    time is steps - forward - communication)."""

    steps: float = 0.0
    forward: float = 0.0
    num_steps: int = 0


def split_micro_batches(token_counts: Sequence[int], parts: int) -> list[range]:
    """Cuts a batch of sequences (their token counts) into at most `parts` contiguous runs of about equal
    tokens, none empty."""
    parts = max(1, min(parts, len(token_counts)))
    total, runs, start, acc = sum(token_counts), [], 0, 0
    for i, count in enumerate(token_counts):
        acc += count
        left_seqs, left_runs = len(token_counts) - i - 1, parts - len(runs) - 1
        if left_runs and (acc * parts >= total * (len(runs) + 1) or left_seqs == left_runs):
            runs.append(range(start, i + 1))
            start = i + 1
    runs.append(range(start, len(token_counts)))
    return runs


class ModelRunner:
    """comm: the rank's communicators when the replica spans processes; samples: whether this rank computes
    logits and samples (the sampler rank, or a single process)."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, *, comm: ParallelComm | None = None,
                 samples: bool = True, micro_batches: int = 1):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.comm = comm
        self.samples = samples
        self.micro_batches = micro_batches if comm is not None and comm.layout.pp > 1 else 1
        self.times = RunnerTimes()
        self._seqs: dict[str, _SeqState] = {}
        # Told after each layer which sequences' prompts this step completes (seq id -> block table): the KV
        # transfer agent sends their layer's KV from there (engine/llm_engine.py, kv_transfer/agent.py).
        self.layer_observer = None
        # The model's compiled decode step (engine/models/compiled.py), or None: every step runs eager.
        self.compiled: CompiledDecode | CudaGraphDecode | None = None
        # Compiles structured-output constraints (engine/grammar.py); set by the engine on a sampling rank.
        self.grammars: GrammarBackend | None = None
        self._mask_pool: ThreadPoolExecutor | None = None

    def execute(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Computes every chunk, writing its K/V to the cache. Returns float32 logits [len(chunks), vocab] of
        each chunk's last token. Raises ValueError if a block table is too short. Single process only."""
        return self.model.compute_logits(self._forward(chunks))

    def _forward(self, chunks: Sequence[SequenceChunk], completing: Sequence[str | None] = (),
                 tails: Sequence[int] = ()) -> torch.Tensor | None:
        """Runs this rank's layers over the chunks, micro-batch by micro-batch. Returns the last stage's final
        hidden states of each chunk's last tails[i] tokens (1 where tails is short), chunk after chunk
        [sum of tails, hidden]; None on the other stages. completing[i]: the seq id of chunk i if it completes that
        sequence's prompt (for layer_observer)."""
        shard = self.model.shard
        runs = split_micro_batches([len(c.token_ids) for c in chunks], self.micro_batches)
        observers = [self._layer_callback({completing[i]: chunks[i].block_ids for i in run
                                           if i < len(completing) and completing[i]}) for run in runs]
        inputs = [self._inputs([chunks[i] for i in run]) for run in runs]
        receives = []
        if not shard.is_first_stage:  # post every receive now: micro-batch i + 1 arrives while i computes
            for ids, _, _ in inputs:
                buffer = torch.empty(ids.shape[0], self.model.config.hidden_size, dtype=self.model.dtype,
                                     device=self.device)
                receives.append((buffer, self.comm.recv_prev(buffer)))
        outputs, sends = [], []
        for i, (ids, positions, meta) in enumerate(inputs):
            hidden = None
            if receives:
                hidden, work = receives[i]
                self.comm.wait(work)
            start = time.perf_counter()
            out = run_step(self.model, ids, positions, meta, self.kv_cache, hidden, observers[i], self.compiled)
            self.times.forward += time.perf_counter() - start
            if shard.is_last_stage:
                rows = [end - j for c, end in zip(runs[i], meta.query_start_loc[1:])
                        for j in range(tails[c] if c < len(tails) else 1, 0, -1)]
                outputs.append(out[torch.tensor(rows, device=self.device)])
            else:
                sends.append((out, self.comm.send_next(out)))
        for _, work in sends:
            self.comm.wait(work)
        return torch.cat(outputs) if outputs else None

    def _layer_callback(self, tables: dict[str, tuple[int, ...]]):
        if self.layer_observer is None or not tables:
            return None
        return lambda layer: self.layer_observer.on_layers_done(layer, tables)

    def _inputs(self, chunks: Sequence[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids = [t for c in chunks for t in c.token_ids]
        positions = [p for c in chunks for p in range(c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids))]
        meta = AttentionMetadata.build(
            query_lens=[len(c.token_ids) for c in chunks],
            num_computed=[c.num_computed_tokens for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            block_size=self.kv_cache.spec.block_size,
            device=self.device,
        )
        return (torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device), meta)

    @torch.inference_mode()
    def execute_step(self, output: SchedulerOutput,
                     prev_tokens: Mapping[str, Sequence[int]] | None = None) -> RunnerOutput:
        """Applies the scheduler's decisions (see scheduler_output.py for the order), runs one forward pass and
        samples. prev_tokens: on a rank that does not sample, the tokens the sampler rank emitted last step, by seq id.
        Returns an empty RunnerOutput on such ranks. Raises KeyError if a cached sequence was never sent in full."""
        start = time.perf_counter()
        try:
            return self._execute_step(output, prev_tokens or {})
        finally:
            self.times.steps += time.perf_counter() - start
            self.times.num_steps += 1

    def _execute_step(self, output: SchedulerOutput, prev_tokens: Mapping[str, Sequence[int]]) -> RunnerOutput:
        for seq_id, token_ids in prev_tokens.items() if not self.samples else ():
            if seq_id in self._seqs:
                self._seqs[seq_id].token_ids.extend(token_ids)
        for seq_id in output.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        for new in output.new_seqs:
            state = _SeqState(list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.params, new.seed)
            if new.params.structured is not None and self.samples:
                if self.grammars is None:
                    raise ValueError("structured output needs the engine's grammar backend (runner.grammars)")
                # A resumed, migrated or recomputed sequence replays the output it delivered already.
                grammar = self.grammars.compile(new.params.structured)
                state.matcher = grammar.matcher(state.token_ids[state.num_prompt_tokens:])
            self._seqs[new.seq_id] = state
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
        chunks, to_sample, completing, tails = [], [], [], []
        row_of, next_row = {}, 0  # seq id -> its first row of the forward's output
        for seq_id, count in output.num_scheduled_tokens.items():
            state = self._seqs[seq_id]
            start = computed[seq_id]
            proposed = output.spec_tokens.get(seq_id, ())
            tokens = (*state.token_ids[start:start + count - len(proposed)], *proposed)
            chunks.append(SequenceChunk(tokens, start, tuple(state.block_ids)))
            ends = start + count - len(proposed) == len(state.token_ids)
            if ends:
                to_sample.append(seq_id)
            completing.append(seq_id if ends and len(state.token_ids) == state.num_prompt_tokens else None)
            tails.append(1 + len(proposed))
            row_of[seq_id], next_row = next_row, next_row + tails[-1]
        rows, names = [], []
        for seq_id in to_sample:
            rows.append(row_of[seq_id])
            names.append(seq_id)
        for fork in output.forks:
            parent = self._seqs[fork.parent_id]
            self._seqs[fork.child_id] = _SeqState(list(parent.token_ids), parent.num_prompt_tokens,
                                                  list(parent.block_ids), parent.params, fork.seed,
                                                  parent.matcher.copy() if parent.matcher is not None else None)
            rows.append(row_of[fork.parent_id])
            names.append(fork.child_id)
        masks = self._start_masks(names) if self.samples else None
        hidden = self._forward(chunks, completing, tails)
        if not rows or not self.samples:
            return RunnerOutput()
        # A speculating sequence samples at each of its 1 + k positions, each row as if the proposals before it had
        # been sampled: name i's rows are requests[first[i]:first[i] + 1 + k].
        requests, all_rows, first = [], [], []
        for name, row in zip(names, rows):
            state, proposed = self._seqs[name], output.spec_tokens.get(name, ())
            if proposed and state.matcher is not None:
                raise ValueError(f"sequence {name} has structured output: it cannot speculate")
            first.append(len(requests))
            for j in range(len(proposed) + 1):
                requests.append(state.sample_request(proposed[:j]))
                all_rows.append(row + j)
        logits = self.model.compute_logits(hidden[torch.tensor(all_rows, device=self.device)])
        if masks is not None:
            masks.apply(logits, first)
        drawn = sample_batch(logits, requests)
        sampled, speculated = {}, {}
        for name, at in zip(names, first):
            state, proposed = self._seqs[name], output.spec_tokens.get(name, ())
            emitted = accept_drawn(proposed, drawn[at:at + len(proposed) + 1])
            sampled[name] = emitted[0]
            if proposed:
                speculated[name] = emitted[1:]
            state.token_ids.extend(t.token_id for t in emitted)
            if state.matcher is not None and not state.matcher.accept(emitted[0].token_id):
                _log.error("sequence %s: sampled token %d is outside its grammar (%s)", name, emitted[0].token_id,
                           state.matcher.error)
        return RunnerOutput(sampled, speculated)

    def _start_masks(self, names: Sequence[str]) -> MaskJob | None:
        """Starts computing the allowed next tokens of this step's structured rows (their index in `names`) on a
        helper thread, to overlap the forward pass; None when no row is structured."""
        structured = [(self._seqs[name].matcher, i) for i, name in enumerate(names)
                      if self._seqs[name].matcher is not None]
        if not structured:
            return None
        from tandem.engine.grammar_masks import MaskJob  # torch + llguidance: only once a request asks for it

        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar-masks")
        return MaskJob(self.grammars, self._mask_pool, structured)
