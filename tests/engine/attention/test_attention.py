"""The paged torch reference backend vs dense causal attention, on scattered block tables and mixed batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.attention.torch_ref import DECODE_KERNELS
from tandem.engine.hardware.kernel_tuning import BucketPlan
from tandem.engine.runner.model_runner import ModelRunner, SequenceChunk

HQ, HK, D, BS, NUM_BLOCKS = 6, 2, 16, 4, 64


def _dense(q, k, v, window=None):
    """Causal attention of all T tokens of one sequence, no cache. q: [T, HQ, D]."""
    t = q.shape[0]
    pos = torch.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_dense(window):
    """Three sequences in one step: a fresh prefill, a chunk after a cached prefix, and a single decode token."""
    g = torch.Generator().manual_seed(0)
    lengths, cached = [9, 23, 14], [0, 16, 13]
    full = [(torch.randn(n, HQ, D, generator=g), torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g))
            for n in lengths]
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, start = [], 0
    for n in lengths:
        tables.append(perm[start:start + -(-n // BS)])
        start += len(tables[-1])
    kv = torch.zeros(2, NUM_BLOCKS, HK, BS, D)
    backend = TorchAttentionBackend()
    # Write the cached prefixes first, as earlier steps would have.
    pre = AttentionMetadata.build([c for c in cached if c], [0 for c in cached if c],
                                  [t for t, c in zip(tables, cached) if c], BS, torch.device("cpu"))
    backend.write_kv(torch.cat([f[1][:c] for f, c in zip(full, cached) if c]),
                     torch.cat([f[2][:c] for f, c in zip(full, cached) if c]), kv, pre)
    meta = AttentionMetadata.build([n - c for n, c in zip(lengths, cached)], cached, tables, BS, torch.device("cpu"))
    q = torch.cat([f[0][c:] for f, c in zip(full, cached)])
    k = torch.cat([f[1][c:] for f, c in zip(full, cached)])
    v = torch.cat([f[2][c:] for f, c in zip(full, cached)])
    out = backend.forward(q, k, v, kv, meta, scale=D**-0.5, window=window)
    expected = torch.cat([_dense(*f, window=window)[c:] for f, c in zip(full, cached)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
@pytest.mark.parametrize("lengths", [[5, 17, 1, 12], [17]], ids=["batch", "one"])  # one: no padding mask
@pytest.mark.parametrize("window", [None, 3])
def test_batched_decode_matches_dense(window, lengths, kernel):
    g = torch.Generator().manual_seed(1)
    full = [(torch.randn(n, HQ, D, generator=g), torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g))
            for n in lengths]
    tables = [[8 * i + j for j in range(-(-n // BS))][::-1] for i, n in enumerate(lengths)]  # reversed order
    kv = torch.zeros(2, NUM_BLOCKS, HK, BS, D)
    backend = TorchAttentionBackend()
    backend.decode_plan = BucketPlan(((1, kernel),))
    prior = [n - 1 for n in lengths]
    idx = [i for i, p in enumerate(prior) if p]
    pre = AttentionMetadata.build([prior[i] for i in idx], [0] * len(idx), [tables[i] for i in idx], BS,
                                  torch.device("cpu"))
    backend.write_kv(torch.cat([full[i][1][:-1] for i in idx]), torch.cat([full[i][2][:-1] for i in idx]), kv, pre)
    meta = AttentionMetadata.build([1] * len(lengths), prior, tables, BS, torch.device("cpu"))
    assert meta.is_decode_only
    out = backend.forward(torch.cat([f[0][-1:] for f in full]), torch.cat([f[1][-1:] for f in full]),
                          torch.cat([f[2][-1:] for f in full]), kv, meta, D**-0.5, window)
    expected = torch.cat([_dense(*f, window=window)[-1:] for f in full])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_block_table_too_short_is_rejected():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        AttentionMetadata.build([9], [0], [[0, 1]], BS, torch.device("cpu"))


def test_chunked_prefill_equals_one_shot(embedded_generator, embedded):
    """The same prompt prefilled in one chunk and in three chunks gives the same next-token logits."""
    ids = tuple(embedded.tokenizer.encode("Paged attention lets a prompt be prefilled in pieces. " * 4))
    runner: ModelRunner = embedded_generator.runner
    pool = embedded_generator.block_pool
    blocks = tuple(pool.allocate(-(-len(ids) // 16)))
    try:
        one_shot = runner.execute([SequenceChunk(ids, 0, blocks)])
        cuts = [0, 7, 30, len(ids)]
        for a, b in zip(cuts, cuts[1:]):
            chunked = runner.execute([SequenceChunk(ids[a:b], a, blocks)])
    finally:
        for block in blocks:
            pool.decref(block, park=False)
    torch.testing.assert_close(chunked, one_shot, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
@pytest.mark.parametrize("window", [None, 3])
def test_a_few_new_tokens_per_sequence_take_the_batched_kernel_and_match_dense(window, kernel):
    """A speculating step: each sequence adds 1-5 tokens after its cached ones (the short-query path: one gather,
    one batched kernel, a causal mask per query)."""
    g = torch.Generator().manual_seed(2)
    lengths, new = [5, 17, 3, 12], [3, 1, 3, 5]
    full = [(torch.randn(n, HQ, D, generator=g), torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g))
            for n in lengths]
    tables = [[8 * i + j for j in range(-(-n // BS))][::-1] for i, n in enumerate(lengths)]
    kv = torch.zeros(2, NUM_BLOCKS, HK, BS, D)
    backend = TorchAttentionBackend()
    backend.decode_plan = BucketPlan(((1, kernel),))
    prior = [n - m for n, m in zip(lengths, new)]
    idx = [i for i, p in enumerate(prior) if p]
    pre = AttentionMetadata.build([prior[i] for i in idx], [0] * len(idx), [tables[i] for i in idx], BS,
                                  torch.device("cpu"))
    backend.write_kv(torch.cat([full[i][1][:prior[i]] for i in idx]), torch.cat([full[i][2][:prior[i]] for i in idx]),
                     kv, pre)
    meta = AttentionMetadata.build(new, prior, tables, BS, torch.device("cpu"))
    out = backend.forward(*(torch.cat([f[j][p:] for f, p in zip(full, prior)]) for j in range(3)), kv, meta, D**-0.5,
                          window)
    assert any(key[0] == "short" for key in meta._per_step)
    expected = torch.cat([_dense(*f, window=window)[p:] for f, p in zip(full, prior)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
