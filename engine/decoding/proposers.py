"""Speculative decoding's proposers: cheap guesses of a sequence's next tokens, which the target model then verifies
(engine/decoding/rejection_sampler.py). Plain Python over token ids: no torch.

A proposer keeps what it needs per sequence and is told each sequence's tokens as they grow; `propose(seq_id,
token_ids, k)` returns at most k tokens (possibly none: nothing worth proposing). This module holds the n-gram
prompt-lookup proposer; engine/decoding/suffix_proposer.py the suffix-trie one; engine/decoding/draft_proposer.py the
draft model, which proposes for a whole batch at once (propose_batch) since each of its positions is a forward pass.
engine/decoding/speculation.py asks them each step and prices what they propose.

Prompt lookup (vLLM's `prompt_lookup_min/max`): if the sequence's last n tokens (n from max_n down to min_n)
occurred earlier in the sequence, propose the tokens that followed that earlier occurrence. vLLM searches the
whole sequence on every step, so its cost grows with the prompt (vLLM #16883); here each sequence keeps an index of
its n-grams, updated with the tokens added since the last call, so a step costs O(max_n) per new token whatever
the prompt's length (and the prompt is indexed once, on the sequence's first proposal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


class Proposer(Protocol):
    """What the engine asks of any proposer."""

    name: str

    def propose(self, seq_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """At most k tokens likely to follow token_ids (the sequence's prompt and output so far)."""

    def forget(self, seq_id: str) -> None:
        """Drops what is kept for a sequence that ended (or was preempted: it starts over if it comes back)."""


@dataclass
class _NgramIndex:
    """For each n, the end (exclusive) of the latest occurrence of each n-gram ending at or before `indexed`."""

    grams: dict[int, dict[tuple[int, ...], int]]
    indexed: int = 0  # grams ending at positions 1..indexed are in the index
    length: int = 0  # the sequence length at the last call, to notice a sequence that was cut back


@dataclass
class NgramProposer:
    """Prompt lookup over each sequence's own tokens. min_n <= max_n, both >= 1. Raises ValueError otherwise."""

    min_n: int = 2
    max_n: int = 4
    name: str = "ngram"
    _seqs: dict[str, _NgramIndex] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, seq_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        length = len(token_ids)
        index = self._seqs.get(seq_id)
        if index is None or length < index.length:  # new, or cut back (a rollback): index it again
            index = self._seqs[seq_id] = _NgramIndex({n: {} for n in range(self.min_n, self.max_n + 1)})
        index.length = length
        # Index every gram that ends before the current end: the current suffix must find an earlier occurrence.
        for end in range(max(index.indexed + 1, self.min_n), length):
            for n, grams in index.grams.items():
                if end >= n:
                    grams[tuple(token_ids[end - n:end])] = end
        index.indexed = max(index.indexed, length - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = index.grams[n].get(tuple(token_ids[length - n:]))
            if end is not None:
                return list(token_ids[end:end + k])
        return []

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
