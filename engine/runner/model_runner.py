"""Runs the model over a batch: builds input tensors and attention metadata, returns logits or sampled tokens.

The runner owns no policy. Which tokens to compute and which KV blocks hold them arrive either as SequenceChunk
objects (execute: single-request generation, tests) or as a SchedulerOutput (execute_step: the engine). For the
engine it keeps a mirror of each scheduled sequence (sequence_mirror.py) that the scheduler updates with diffs,
the split the scheduler/worker boundary keeps when ranks live in other processes; how the model computes a step
is engine/models/step.py's choice, and sampling is sampling_step.py's.

In a replica of several ranks (engine/runner/ranks/) every rank runs a ModelRunner on the same SchedulerOutput. Only
the sampler rank (the last stage's first) computes logits and samples; the others learn the sampled tokens with
the next step (execute_step's `prev_tokens`). With pipeline stages a step's sequences are cut into micro-batches:
a stage sends micro-batch i on and starts i + 1 while the next stage works on i.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.kv.kv_cache import PagedKVCache
from tandem.engine.models import LlamaModel
from tandem.engine.models.lora import LoRAPool
from tandem.engine.models.step import run_step
from tandem.engine.runner.sampling_step import SamplingStep
from tandem.engine.runner.sequence_mirror import SequenceMirror
from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tandem.engine.decoding.grammar import GrammarBackend
    from tandem.engine.kv.tier_store import TierStore
    from tandem.engine.models.compiled import CompiledDecode
    from tandem.engine.models.cuda_graphs import CudaGraphDecode
    from tandem.engine.parallel.comm import ParallelComm


class LayerObserver(Protocol):
    def on_layers_done(self, layer: int, tables: dict[str, tuple[int, ...]]) -> None: ...


@dataclass(frozen=True)
class SequenceChunk:
    """token_ids: the tokens to compute now, at positions num_computed_tokens onwards.
    block_ids: the sequence's whole block table; it must cover num_computed_tokens + len(token_ids)."""

    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]


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
    logits and samples (the sampler rank, or a single process). compiled: the model's compiled decode step
    (engine/models/compiled.py, cuda_graphs.py), or None: every step runs eager. layer_observer: told after each
    layer which sequences' prompts the step completes (seq id -> block table): the KV transfer agent, which sends
    their layer's KV from there (kv_transfer/agent.py). grammars: compiles structured-output constraints
    (engine/decoding/grammar.py), needed on a sampling runner for requests that have one. tiers: this rank's KV
    tier storage (engine/kv/tier_store.py), which runs each step's tier copies beside the model; None: no tiers."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, *, comm: ParallelComm | None = None,
                 samples: bool = True, micro_batches: int = 1, compiled: CompiledDecode | CudaGraphDecode | None = None,
                 layer_observer: LayerObserver | None = None, grammars: GrammarBackend | None = None,
                 tiers: TierStore | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.comm = comm
        self.samples = samples
        self.micro_batches = micro_batches if comm is not None and comm.layout.pp > 1 else 1
        self.compiled = compiled
        self.background_compile = None  # compile: background's BackgroundCompile, which sets `compiled` when ready
        self.layer_observer = layer_observer
        self.tiers = tiers
        self.times = RunnerTimes()
        self.seqs = SequenceMirror(samples, grammars)
        self.sampling = SamplingStep(model, self.seqs) if samples else None
        self.lora = None if model.lora is None else LoRAPool(model.lora, self._read_adapter)
        self._adapter_paths: dict[str, str] = {}  # registered LoRA adapters: name -> PEFT folder

    def _read_adapter(self, name: str):
        from tandem.engine.loader.lora_adapter import read_adapter

        return read_adapter(self._adapter_paths[name], name, self.model.config, self.model.lora.max_rank)

    def _apply_lora_changes(self, output: SchedulerOutput) -> None:
        for change in output.lora_changes:
            if self.lora is None:
                raise ValueError("the engine sent LoRA adapters to a runner without a LoRA pool")
            self.lora.forget(change.name)
            if change.path is None:
                self._adapter_paths.pop(change.name, None)
            else:
                self._adapter_paths[change.name] = change.path

    def execute(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Computes every chunk, writing its K/V to the cache. Returns float32 logits [len(chunks), vocab] of
        each chunk's last token. Raises ValueError if a block table is too short. Single process only."""
        return self.model.compute_logits(self._forward(chunks))

    def _forward(self, chunks: Sequence[SequenceChunk], completing: Sequence[str | None] = (),
                 tails: Sequence[int] = (), adapters: Sequence[str | None] = ()) -> torch.Tensor | None:
        """Runs this rank's layers over the chunks, micro-batch by micro-batch. Returns the last stage's final
        hidden states of each chunk's last tails[i] tokens (1 where tails is short), chunk after chunk
        [sum of tails, hidden]; None on the other stages. completing[i]: the seq id of chunk i if it completes that
        sequence's prompt (for layer_observer). adapters[i]: the LoRA adapter chunk i computes with (None or
        absent: the base model)."""
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
            if self.lora is not None:
                self.lora.use([adapters[c] if c < len(adapters) else None for c in runs[i]],
                              [len(chunks[c].token_ids) for c in runs[i]])
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
        self.seqs.apply(output, prev_tokens if not self.samples else {})
        self._apply_lora_changes(output)
        if not output.tier_ops.ops:
            return self._compute_step(output)
        if self.tiers is None:
            raise ValueError("the scheduler sent KV tier copies to a runner without tiers")
        self.tiers.start(output.tier_ops)  # ops[:sync] now, before any block is written; the rest beside the model
        try:
            result = self._compute_step(output)
        finally:
            report = self.tiers.wait()
        return result.with_tiers(report)

    def _compute_step(self, output: SchedulerOutput) -> RunnerOutput:
        if output.block_copies:
            self.kv_cache.copy_blocks(output.block_copies)
        if output.is_empty:
            return RunnerOutput()
        computed = {d.seq_id: d.num_computed_tokens for d in (*output.new_seqs, *output.cached_seqs)}
        chunks, names, rows, completing, tails, adapters = [], [], [], [], [], []
        row_of, next_row = {}, 0  # seq id -> its first row of the forward's output
        order = list(output.num_scheduled_tokens)
        if self.lora is not None and any(self.seqs[i].params.lora for i in order):
            order.sort(key=lambda i: self.seqs[i].params.lora or "")  # one adapter's rows side by side: one run
        for seq_id in order:
            count = output.num_scheduled_tokens[seq_id]
            seq = self.seqs[seq_id]
            start = computed[seq_id]
            proposed = output.spec_tokens.get(seq_id, ())
            tokens = (*seq.token_ids[start:start + count - len(proposed)], *proposed)
            chunks.append(SequenceChunk(tokens, start, tuple(seq.block_ids)))
            adapters.append(seq.params.lora)
            ends = start + count - len(proposed) == len(seq.token_ids)
            if ends:
                names.append(seq_id)
            completing.append(seq_id if ends and len(seq.token_ids) == seq.num_prompt_tokens else None)
            tails.append(1 + len(proposed))
            row_of[seq_id], next_row = next_row, next_row + tails[-1]
        rows = [row_of[seq_id] for seq_id in names]
        for fork in output.forks:  # a child samples from its parent's row
            self.seqs.fork(fork)
            names.append(fork.child_id)
            rows.append(row_of[fork.parent_id])
        masks = self.sampling.start_masks(names) if self.sampling is not None else None
        hidden = self._forward(chunks, completing, tails, adapters)
        if not rows or self.sampling is None:
            return RunnerOutput()
        return self.sampling.sample(hidden, names, rows, output.spec_tokens, masks)
