"""Next-token masks of structured output as tensors: a batch's bitmask filled by the grammar backend
(engine/decoding/grammar.py) on a helper thread while the forward pass runs, then applied to the logits."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Sequence

import torch

from tandem.engine.decoding.grammar import GrammarBackend, Matcher

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)] on the CPU, every token allowed."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def fill_masks(backend: GrammarBackend, matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
    """Writes each (matcher, row) pair's allowed tokens into bitmask[row] (a contiguous int32 CPU tensor)."""
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.device.type != "cpu":
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
    backend.fill_masks_at(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets logits[i, t] to -inf wherever bit t of bitmask[i] is 0. logits: float [rows, vocab] (modified in
    place); bitmask: int32 [rows, ceil(vocab / 32)] on any device (moved to the logits' device)."""
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


class MaskJob:
    """The next-token masks of one step's structured rows, computed on a helper thread (the GIL released) while
    the forward pass runs; apply() waits for them and masks the logits."""

    def __init__(self, backend: GrammarBackend, pool: Executor, matchers: Sequence[tuple[Matcher, int]]):
        """matchers: (matcher, row of the step's logits) for every structured row."""
        self.rows = [row for _, row in matchers]
        self.bitmask = allocate_bitmask(len(self.rows), backend.vocab_size)
        self._done = pool.submit(fill_masks, backend, [(m, i) for i, (m, _) in enumerate(matchers)], self.bitmask)

    def apply(self, logits: torch.Tensor, placed: Sequence[int] | None = None) -> None:
        """Masks logits [rows, vocab] in place; placed[r]: the logits row of the job's row r, where the logits have
        more rows than the job was told (a speculating sequence's). Raises what filling the masks raised."""
        self._done.result()
        rows = self.rows if placed is None else [placed[r] for r in self.rows]
        if rows == list(range(logits.shape[0])):
            apply_bitmask(logits, self.bitmask)
            return
        index = torch.tensor(rows, device=logits.device)
        masked = logits.index_select(0, index)
        apply_bitmask(masked, self.bitmask)
        logits.index_copy_(0, index, masked)
