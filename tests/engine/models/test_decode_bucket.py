"""A full CUDA graph's bucket (engine/models/decode_bucket.py) without a GPU: the static-input arithmetic (padding
rows, table widths, split counts per bucket), and the graph's body itself, run on the CPU over padded inputs with the
Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py), against the eager step: the same
greedy tokens and hidden states, and a KV cache in which padding wrote nothing of its own."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.models.cuda_graphs import batch_buckets
from tandem.engine.models.decode_bucket import BucketShape, DecodeInputs, blocks_per_sequence, pad_rows, run_body


def test_padding_rows_copy_row_zero():
    assert pad_rows(3, 4) == [0, 1, 2, 0]
    assert pad_rows(4, 4) == [0, 1, 2, 3]
    assert pad_rows(1, 8) == [0] * 8
    for n in (0, 5):
        with pytest.raises(ValueError, match="holds 1 to 4 sequences"):
            pad_rows(n, 4)


def test_block_tables_are_as_wide_as_the_longest_sequence_can_need():
    assert blocks_per_sequence(2048, 16) == 128
    assert blocks_per_sequence(2049, 16) == 129
    assert blocks_per_sequence(5, 16) == 1
    with pytest.raises(ValueError, match="at least 1"):
        blocks_per_sequence(0, 16)


def test_each_bucket_fixes_its_decode_split_count():
    """The kernel's own choice for the bucket's rows at the full width: many splits for one long sequence, fewer as
    the rows fill the device, one when tables are short; whatever step later fills the bucket."""
    from tandem.engine.attention.triton_decode import choose_splits

    shapes = [BucketShape.plan(size, 128, 3) for size in batch_buckets(64)]
    assert [s.size for s in shapes] == batch_buckets(64) and {s.width for s in shapes} == {128}
    assert [s.splits for s in shapes] == [choose_splits(s.size, 3, 128) for s in shapes]
    assert shapes[0].splits == 32 and shapes[-1].splits == 2  # 128 blocks in runs of 4; 64 x 3 programs already
    assert all(a.splits >= b.splits for a, b in zip(shapes, shapes[1:]))
    assert BucketShape.plan(8, 4, 3).splits == 1
    meta = DecodeInputs(shapes[2], 16, "cpu").metadata()  # bucket 4
    assert meta.is_decode_only and meta.query_start_loc == (0, 1, 2, 3, 4) and meta.decode_splits == shapes[2].splits
    assert meta.block_tables.shape == (4, 128)


def _decode_meta(tables: list[list[int]], lens: list[int], block_size: int) -> AttentionMetadata:
    """A decode step: sequence i adds its token at position lens[i] - 1."""
    return AttentionMetadata.build([1] * len(lens), [n - 1 for n in lens], tables, block_size, torch.device("cpu"))


def test_a_step_fills_its_rows_then_copies_of_row_zero():
    inputs = DecodeInputs(BucketShape(4, 6, 2), 4, "cpu")
    meta = _decode_meta([[5, 2, 9], [7], [3, 12]], [10, 2, 6], 4)
    inputs.fill(torch.tensor([11, 12, 13]), torch.tensor([9, 1, 5]), meta)
    assert inputs.input_ids.tolist() == [11, 12, 13, 11]
    assert inputs.positions.tolist() == [9, 1, 5, 9]
    assert inputs.seq_lens.tolist() == [10, 2, 6, 10]
    assert inputs.slot_mapping.tolist() == [9 * 4 + 1, 7 * 4 + 1, 12 * 4 + 1, 9 * 4 + 1]
    assert inputs.block_tables.tolist() == [[5, 2, 9, 0, 0, 0], [7, 0, 0, 0, 0, 0], [3, 12, 0, 0, 0, 0],
                                            [5, 2, 9, 0, 0, 0]]
    # A narrower step rewrites only its width: the columns past it are stale, and never read (past every length).
    inputs.fill(torch.tensor([20]), torch.tensor([0]), _decode_meta([[4]], [1], 4))
    assert inputs.input_ids.tolist() == [20] * 4 and inputs.seq_lens.tolist() == [1] * 4
    assert inputs.block_tables[:, 0].tolist() == [4] * 4 and inputs.block_tables[0, 1:3].tolist() == [2, 9]


def test_a_step_that_does_not_fit_the_bucket_says_why():
    inputs = DecodeInputs(BucketShape(4, 2, 1), 4, "cpu")
    assert inputs.refuses(3, _decode_meta([[1], [2, 3], [4]], [3, 6, 1], 4)) is None
    assert "wider than the graphs' 2" in inputs.refuses(1, _decode_meta([[1, 2, 3]], [9], 4))
    assert "do not fit a bucket of 4" in inputs.refuses(5, _decode_meta([[1]] * 5, [1] * 5, 4))
    assert "blocks hold 8 tokens" in inputs.refuses(1, _decode_meta([[1]], [1], 8))
    prefill = AttentionMetadata.build([3], [0], [[1]], 4, torch.device("cpu"))
    assert "not one new token per sequence" in inputs.refuses(3, prefill)


BLOCK_SIZE = 4
TABLES = [[5, 2, 9, 14], [7, 11, 4, 13], [3, 12, 1, 8]]  # scattered; block 0 and a few others stay unused


@pytest.mark.parametrize("model_name, eager_backend, steps", [("tiny_llama", "triton", 3), ("embedded", "torch", 1)])
def test_the_body_over_a_padded_bucket_is_the_eager_step(model_name, eager_backend, steps, request):
    """Three prompts of 5, 9 and 13 tokens prefilled, then decode steps run twice, each on its own copy of the
    cache: by the eager step on the three rows, and by the bucket's body on four rows (one of them padding), with
    tables 6 blocks wide (4 needed) and 2 splits of 3 blocks (the second reached by the longest sequence only).
    Three steps against the eager Triton step on the tiny Llama (3 layers); one against the engine's CPU eager
    step (the torch reference) on the embedded model (30 layers, GQA 9/3: ~20 s under the interpreter)."""
    from tandem.engine.attention.triton_backend import TritonAttentionBackend

    model = request.getfixturevalue(model_name).model
    c = model.config
    spec = KVCacheSpec(c.num_layers, 16, BLOCK_SIZE, model.num_kv_heads, c.head_dim, model.dtype)
    eager_kv, body_kv = PagedKVCache(spec), PagedKVCache(spec)
    prompts = [list(range(100, 100 + n)) for n in (5, 9, 13)]
    inputs = DecodeInputs(BucketShape(4, 6, 2), BLOCK_SIZE, "cpu")
    eager = TritonAttentionBackend() if eager_backend == "triton" else TorchAttentionBackend()
    try:
        model.attention = TorchAttentionBackend()  # the prefill, the same for both
        prefill = AttentionMetadata.build([len(p) for p in prompts], [0, 0, 0], TABLES, BLOCK_SIZE,
                                          torch.device("cpu"))
        positions = torch.tensor([i for p in prompts for i in range(len(p))])
        hidden = model.forward(torch.tensor(sum(prompts, [])), positions, prefill, eager_kv)
        body_kv.data.copy_(eager_kv.data)
        tokens = model.compute_logits(hidden[torch.tensor(prefill.query_start_loc[1:]) - 1]).argmax(-1)
        lens = [len(p) for p in prompts]
        for _ in range(steps):
            lens = [n + 1 for n in lens]
            ids, positions = tokens, torch.tensor(lens) - 1
            meta = _decode_meta(TABLES, lens, BLOCK_SIZE)
            model.attention = eager
            expected = model.forward(ids, positions, meta, eager_kv)
            model.attention = TritonAttentionBackend()
            before = body_kv.data.clone()
            assert inputs.refuses(3, meta) is None
            inputs.fill(ids, positions, meta)
            out = run_body(model, inputs, body_kv)
            assert out.shape == (4, c.hidden_size) and torch.equal(out[3], out[0])  # padding computed row 0's values
            assert torch.allclose(out[:3], expected, rtol=1e-4, atol=1e-4)
            tokens = model.compute_logits(out[:3]).argmax(-1)
            assert torch.equal(tokens, model.compute_logits(expected).argmax(-1))
            # Every layer's three real slots were written, as eager wrote them, and nothing else was.
            written = torch.zeros(spec.num_blocks * BLOCK_SIZE, dtype=torch.bool)
            written[meta.slot_mapping] = True
            written = written.view(spec.num_blocks, BLOCK_SIZE)[None, None, :, None, :, None]
            assert torch.equal(body_kv.data.masked_fill(written, 0), before.masked_fill(written, 0))
            assert torch.allclose(body_kv.data, eager_kv.data, rtol=1e-4, atol=1e-4)
    finally:
        model.attention = TorchAttentionBackend()  # the session-wide models go back to the reference


def test_the_body_needs_the_triton_backend(tiny_llama):
    """The torch reference reads the Python-side sequence lengths, which the bucket's metadata only pretends."""
    model = tiny_llama.model
    c = model.config
    kv = PagedKVCache(KVCacheSpec(c.num_layers, 4, BLOCK_SIZE, model.num_kv_heads, c.head_dim, model.dtype))
    assert isinstance(model.attention, TorchAttentionBackend)
    with pytest.raises(ValueError, match="runs the Triton attention backend, not TorchAttentionBackend"):
        run_body(model, DecodeInputs(BucketShape(2, 2, 1), BLOCK_SIZE, "cpu"), kv)
