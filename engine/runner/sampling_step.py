"""The sampling half of a runner's step, on the rank that samples: starts the grammar masks of the step's
structured rows before the forward pass (they overlap it on a helper thread), then, from the final hidden states,
computes the logits of every row to sample, masks them, samples, accepts or rejects speculated tokens and
advances each sequence (its tokens, its grammar matcher)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from tandem.engine.decoding.rejection_sampler import accept_drawn
from tandem.engine.decoding.sampler import sample_batch
from tandem.engine.runner.sequence_mirror import SequenceMirror
from tandem.engine.scheduler_output import RunnerOutput

if TYPE_CHECKING:
    from tandem.engine.decoding.grammar_masks import MaskJob
    from tandem.engine.models import LlamaModel

_log = logging.getLogger(__name__)


class SamplingStep:
    def __init__(self, model: LlamaModel, seqs: SequenceMirror):
        self.model = model
        self.seqs = seqs  # with the grammar backend that compiled its matchers
        self._mask_pool: ThreadPoolExecutor | None = None

    def start_masks(self, names: Sequence[str]) -> MaskJob | None:
        """Starts computing the allowed next tokens of the structured rows among `names` (the sequences this step
        samples, in row order) on a helper thread; None when no row is structured."""
        structured = [(self.seqs[name].matcher, i) for i, name in enumerate(names)
                      if self.seqs[name].matcher is not None]
        if not structured:
            return None
        from tandem.engine.decoding.grammar_masks import MaskJob  # torch + llguidance: only once a request asks for it

        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar-masks")
        return MaskJob(self.seqs.grammars, self._mask_pool, structured)

    def sample(self, hidden: torch.Tensor, names: Sequence[str], rows: Sequence[int],
               spec_tokens: Mapping[str, tuple[int, ...]], masks: MaskJob | None) -> RunnerOutput:
        """names[i]'s next token from hidden's row rows[i] (a speculating sequence: from that row and the next
        len(proposals), each as if the proposals before it had been sampled), its proposals verified."""
        requests, all_rows, first = [], [], []  # name i's sampler rows: requests[first[i]:first[i] + 1 + k]
        for name, row in zip(names, rows):
            seq, proposed = self.seqs[name], spec_tokens.get(name, ())
            if proposed and seq.matcher is not None:
                raise ValueError(f"sequence {name} has structured output: it cannot speculate")
            first.append(len(requests))
            for j in range(len(proposed) + 1):
                requests.append(seq.sample_request(proposed[:j]))
                all_rows.append(row + j)
        logits = self.model.compute_logits(hidden[torch.tensor(all_rows, device=hidden.device)])
        if masks is not None:
            masks.apply(logits, first)
        drawn = sample_batch(logits, requests)
        sampled, speculated = {}, {}
        for name, at in zip(names, first):
            seq, proposed = self.seqs[name], spec_tokens.get(name, ())
            emitted = accept_drawn(proposed, drawn[at:at + len(proposed) + 1])
            sampled[name] = emitted[0]
            if proposed:
                speculated[name] = emitted[1:]
            seq.token_ids.extend(t.token_id for t in emitted)
            if seq.matcher is not None and not seq.matcher.accept(emitted[0].token_id):
                _log.error("sequence %s: sampled token %d is outside its grammar (%s)", name, emitted[0].token_id,
                           seq.matcher.error)
        return RunnerOutput(sampled, speculated)
