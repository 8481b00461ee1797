"""What an attention backend needs to know about a batch: where each sequence's tokens and KV blocks are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """A flattened batch of sequences.

    The batch's new tokens are concatenated; sequence i owns rows query_start_loc[i]:query_start_loc[i+1].
    seq_lens[i] counts every token whose K/V is visible to sequence i after this step (cached + new), so
    its new tokens sit at positions seq_lens[i] - query_len .. seq_lens[i] - 1. slot_mapping gives, per new
    token, the flat KV slot (block_id * block_size + offset) its K/V is written to.
    """

    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64; unused entries are 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    seq_lens_tensor: torch.Tensor  # [num_seqs] int64
    block_size: int
    # The Triton decode kernel's split count, fixed by a full CUDA graph's bucket (engine/models/decode_bucket.py) so
    # that its grid never changes; None: the kernel chooses from the batch (triton_decode.choose_splits).
    decode_splits: int | None = None
    # Index tensors every layer of a step shares, computed by the first layer that asks (see the methods below).
    _per_step: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        """The most new tokens any one sequence adds this step."""
        return max((b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:])), default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.query_start_loc[-1] == self.num_seqs

    def kv_rows(self, num_kv_heads: int, num_blocks: int, rows_per_block: int | None = None) -> torch.Tensor:
        """[2 * num_tokens * num_kv_heads] rows of one layer's head-major cache, viewed as
        [2 * num_blocks * num_kv_heads * rows_per_block, head_dim], that the new tokens' K heads (in (token, head)
        order), then their V heads, are written to. rows_per_block: block_size, plus one for a quantized cache's
        scale row (engine/kv/kv_cache.py)."""
        def rows() -> torch.Tensor:
            bs, slots = self.block_size, self.slot_mapping
            per = rows_per_block or bs
            heads = torch.arange(num_kv_heads, device=slots.device) * per
            k = ((slots // bs) * (num_kv_heads * per) + slots % bs)[:, None].add(heads).view(-1)
            return torch.cat([k, k + num_blocks * num_kv_heads * per])

        return self.per_step(("kv_rows", num_kv_heads, num_blocks, rows_per_block), rows)

    def per_step(self, key, make):
        """A value every layer of the step shares (e.g. an index tensor), computed by the first layer that asks."""
        if key not in self._per_step:
            self._per_step[key] = make()
        return self._per_step[key]

    def decode_hidden(self, window: int | None) -> torch.Tensor:
        """For a decode-only batch: bool [num_seqs, max(seq_lens)], True where a key position is not visible to
        the sequence's query (padding past its length, or outside a sliding window)."""
        def hidden() -> torch.Tensor:
            kpos = torch.arange(max(self.seq_lens), device=self.seq_lens_tensor.device)[None, :]
            qpos = self.seq_lens_tensor[:, None] - 1
            mask = kpos > qpos
            if window is not None:
                mask |= qpos - kpos >= window
            return mask

        return self.per_step(("decode_hidden", window), hidden)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Builds metadata for sequences that add query_lens[i] tokens after num_computed[i] cached ones.

        Raises ValueError if a block table is too short to hold the sequence after this step.
        """
        starts = [0]
        slots: list[int] = []
        seq_lens = []
        for qlen, done, table in zip(query_lens, num_computed, block_tables):
            total = done + qlen
            if len(table) * block_size < total:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {total} tokens")
            for pos in range(done, total):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            starts.append(starts[-1] + qlen)
            seq_lens.append(total)
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=tuple(starts),
            seq_lens=tuple(seq_lens),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_size=block_size,
        )
