"""One batch bucket of the decode step captured whole, attention included (the "full" CUDA graphs of
engine/models/cuda_graphs.py): the bucket's static inputs, how a step's rows fill them, and the body a graph records.

A CUDA graph replays its kernels with the arguments, grids and buffers they had at capture. So everything a decode
step's kernels read is static per bucket of B rows, fixed when the graphs are built:

- input_ids [B], positions [B], seq_lens [B], slot_mapping [B] and block_tables [B, W] (int64, on the device), W the
  most blocks a sequence can hold (ceil(max_model_len / block_size), blocks_per_sequence);
- the decode kernel's split count, choose_splits(B, kv_heads, W) (BucketShape.plan): its grid (B, kv_heads,
  splits) and its blocks per split (ceil(W / splits)) never change. Splits past a short sequence's end find no
  key and the combine gives them zero weight, so a wide W costs a few empty programs, never a wrong result;
- an AttentionMetadata over these tensors, decode-only (query_start_loc 0..B), made afresh for each run of the
  body (DecodeInputs.metadata): the index tensors it computes once per step (the KV write's rows) are then
  computed inside the run, so a graph recomputes them on every replay instead of reading what a warm-up left.

A step of n <= B sequences copies its rows into the buffers (DecodeInputs.fill): rows 0..n-1 are the step's, rows
n..B-1 copies of row 0 (its token, position, block-table row, sequence length and slot). Why padding cannot corrupt
the KV cache: every op of the body but attention computes a row from that row alone, and attention computes a row
from the cache, that row's table and its length. A copy of row 0 thus computes row 0's values bit for bit (the
one assumption: a product computes equal rows of one call equally, as the tiled kernels of cuBLAS and Triton do,
whose reduction order for an output element is set by its column and the kernel, not its row) and writes them to
row 0's slot, where row 0 writes the same bytes. So the cache after a padded step holds exactly what the n real
rows write. (A scratch slot for padding would need a block no sequence can own, which the block pool does not
keep.) Table entries past a sequence's last block, left by an earlier step with a wider table, are never read: the
kernel reads a sequence's table only below ceil(seq_len / block_size).

The body (run_body) is plain code: a CUDA graph records one run of it, and off the GPU it runs as it is (Triton's
interpreter on the CPU), which is how the tests check padding and the fixed widths against the eager step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from tandem.engine.kv.kv_cache import PagedKVCache
    from tandem.engine.models.llama import LlamaModel


def pad_rows(n: int, size: int) -> list[int]:
    """Which of a step's n rows each of a bucket's `size` rows copies: 0..n-1, then row 0 for every padding row.
    Raises ValueError unless 1 <= n <= size."""
    if not 1 <= n <= size:
        raise ValueError(f"a bucket of {size} rows holds 1 to {size} sequences, not {n}")
    return list(range(n)) + [0] * (size - n)


def blocks_per_sequence(max_model_len: int, block_size: int) -> int:
    """W: the most KV blocks a sequence of at most max_model_len tokens holds (the block tables' static width)."""
    if max_model_len < 1 or block_size < 1:
        raise ValueError(f"max_model_len ({max_model_len}) and block_size ({block_size}) must be at least 1")
    return -(-max_model_len // block_size)


@dataclass(frozen=True)
class BucketShape:
    """What is fixed per bucket: its rows (size), the block tables' width in blocks, the decode kernel's splits."""

    size: int
    width: int
    splits: int

    @classmethod
    def plan(cls, size: int, width: int, num_kv_heads: int) -> BucketShape:
        """The split count the decode kernel would choose for a batch of `size` sequences with tables `width`
        blocks wide (imports Triton: only a model on the Triton backend builds full graphs)."""
        from tandem.engine.attention.triton_decode import choose_splits

        return cls(size, width, choose_splits(size, num_kv_heads, width))


class DecodeInputs:
    """One bucket's static buffers (see the module docstring), on `device`. They start as a one-token step of token
    0 at position 0 in slot 0 (block 0), which is what a warm-up run of the body computes and writes."""

    def __init__(self, shape: BucketShape, block_size: int, device: torch.device | str):
        b = shape.size
        self.shape = shape
        self.block_size = block_size
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(b, shape.width, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(b, dtype=torch.int64, device=device)
        # Row n - 1: pad_rows(n, b), so that filling a step of n rows is one index_select per buffer.
        self._rows = torch.tensor([pad_rows(n, b) for n in range(1, b + 1)], dtype=torch.int64, device=device)

    def metadata(self) -> AttentionMetadata:
        """A new decode-only AttentionMetadata over the static tensors (nothing computed yet for the step). Its
        Python-side seq_lens are placeholders (ones): the Triton backend reads only their count, and the torch
        backend, which reads the values, never runs the body (run_body)."""
        b = self.shape.size
        return AttentionMetadata(query_start_loc=tuple(range(b + 1)), seq_lens=(1,) * b,
                                 block_tables=self.block_tables, slot_mapping=self.slot_mapping,
                                 seq_lens_tensor=self.seq_lens, block_size=self.block_size,
                                 decode_splits=self.shape.splits)

    def refuses(self, num_rows: int, meta: AttentionMetadata) -> str | None:
        """Why a step of num_rows tokens with this metadata cannot run in this bucket, or None if it can."""
        if not meta.is_decode_only or meta.num_seqs != num_rows:
            return "the step is not one new token per sequence"
        if num_rows > self.shape.size:
            return f"{num_rows} sequences do not fit a bucket of {self.shape.size}"
        if meta.block_size != self.block_size:
            return f"the step's blocks hold {meta.block_size} tokens, the graphs' {self.block_size}"
        if meta.block_tables.shape[1] > self.shape.width:
            return (f"a block table of {meta.block_tables.shape[1]} blocks is wider than the graphs' "
                    f"{self.shape.width}")
        return None

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copies a decode step of n sequences into the buffers: its rows first, then copies of its row 0 (see the
        module docstring). Six small device copies, no host synchronisation. The step must fit (refuses)."""
        rows = self._rows[input_ids.shape[0] - 1]
        torch.index_select(input_ids, 0, rows, out=self.input_ids)
        torch.index_select(positions, 0, rows, out=self.positions)
        torch.index_select(meta.seq_lens_tensor, 0, rows, out=self.seq_lens)
        torch.index_select(meta.slot_mapping, 0, rows, out=self.slot_mapping)
        # Columns past the step's width keep what an earlier step left: never read (the module docstring).
        self.block_tables[:, : meta.block_tables.shape[1]] = meta.block_tables.index_select(0, rows)


class _BodyOps:
    """run_layers' products and attention in the body: plain calls, attention over the bucket's static metadata and
    without a layer observer (a graph cannot call back into Python between its layers)."""

    def __init__(self, model: LlamaModel, meta: AttentionMetadata, kv_cache: PagedKVCache):
        self.model = model
        self.meta = meta
        self.kv_cache = kv_cache

    @staticmethod
    def project(projection, x: torch.Tensor) -> torch.Tensor:
        return projection(x)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.model.attend(index, q, k, v, self.meta, self.kv_cache, None)


def run_body(model: LlamaModel, inputs: DecodeInputs, kv_cache: PagedKVCache) -> torch.Tensor:
    """What a full graph records: the model's layers over the bucket's static inputs, attention included (each
    layer's KV write at the static slots, the decode kernel with the bucket's split count, the combine). Returns the
    hidden states [size, hidden]; rows past the step's are padding. Mutates kv_cache at inputs.slot_mapping in every
    layer. Makes no host synchronisation, so it can be captured. Raises ValueError unless the model runs the Triton
    attention backend: the torch reference reads the Python-side sequence lengths, which are not the step's."""
    from tandem.engine.attention.triton_backend import TritonAttentionBackend

    if not isinstance(model.attention, TritonAttentionBackend):
        raise ValueError("the decode step's full graph runs the Triton attention backend, not "
                         f"{type(model.attention).__name__}")
    ops = _BodyOps(model, inputs.metadata(), kv_cache)
    return model.run_layers(inputs.input_ids, inputs.positions, None, ops)
