"""The runner's copy of the scheduler's sequences: what each scheduled sequence holds (tokens, block table,
sampling settings, its place in its grammar), kept current by the diffs each SchedulerOutput carries
(engine/scheduler_output.py says what they are and in which order they apply). Plain Python: a rank in another
process keeps the same copy from the same messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from tandem.engine.decoding.sampler import SampleRequest
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler_output import ForkData, SchedulerOutput

if TYPE_CHECKING:
    from tandem.engine.decoding.grammar import GrammarBackend, Matcher


@dataclass
class MirroredSequence:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int
    matcher: Matcher | None = None  # the sequence's place in its grammar (structured output), on a sampling rank

    def sample_request(self, proposed: Sequence[int] = ()) -> SampleRequest:
        """The sampler's row for the sequence's next token, or, with proposed tokens, for the token after them."""
        return SampleRequest.after(self.params, self.seed, self.token_ids, self.num_prompt_tokens, proposed)


class SequenceMirror:
    """samples: whether this copy's rank samples, and so keeps each structured sequence's matcher; grammars
    compiles their constraints (engine/decoding/grammar.py)."""

    def __init__(self, samples: bool, grammars: GrammarBackend | None):
        self.samples = samples
        self.grammars = grammars
        self._seqs: dict[str, MirroredSequence] = {}

    def __getitem__(self, seq_id: str) -> MirroredSequence:
        return self._seqs[seq_id]

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def apply(self, output: SchedulerOutput, prev_tokens: Mapping[str, Sequence[int]] = {}) -> None:
        """Brings the copy up to the step `output` describes, before the model runs: prev_tokens (a rank that does
        not sample learns last step's tokens with this one), then the finished, new and cached sequences. Raises
        KeyError for a diff of a sequence never sent in full, ValueError for a structured sequence without a
        grammar backend."""
        for seq_id, token_ids in prev_tokens.items():
            if seq_id in self._seqs:
                self._seqs[seq_id].token_ids.extend(token_ids)
        for seq_id in output.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        for new in output.new_seqs:
            seq = MirroredSequence(list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.params,
                                   new.seed)
            if new.params.structured is not None and self.samples:
                if self.grammars is None:
                    raise ValueError("structured output needs the engine's grammar backend (ModelRunner(grammars=))")
                # A resumed, migrated or recomputed sequence replays the output it delivered already.
                grammar = self.grammars.compile(new.params.structured)
                seq.matcher = grammar.matcher(seq.token_ids[seq.num_prompt_tokens:])
            self._seqs[new.seq_id] = seq
        for diff in output.cached_seqs:
            seq = self._seqs[diff.seq_id]
            if diff.block_ids is not None:
                seq.block_ids = list(diff.block_ids)
            else:
                seq.block_ids.extend(diff.new_block_ids)

    def fork(self, fork: ForkData) -> None:
        """Adds a fork's child: its parent's tokens, table and grammar state as they are before this step's
        token, its own seed."""
        parent = self._seqs[fork.parent_id]
        self._seqs[fork.child_id] = MirroredSequence(
            list(parent.token_ids), parent.num_prompt_tokens, list(parent.block_ids), parent.params, fork.seed,
            parent.matcher.copy() if parent.matcher is not None else None)
