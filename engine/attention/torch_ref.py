"""The torch reference attention backend: writes K/V into paged blocks and reads them back through block tables.

It is the correctness baseline (CPU, tests) that the Triton kernels are checked against. One layer's cache is
[2, num_blocks, Hk, block_size, D] (K at 0, V at 1): head-major inside a block, so gathering a sequence's blocks
head by head yields K and V already laid out [Hk, tokens, D], the layout attention products read fastest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    """Stateless; one instance serves every layer. fused: an object with rms_norm() and rotary_() kernels the model
    uses around attention (the Triton backend's), or None for the model's own torch ops."""

    fused = None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        """Stores new K/V ([T, Hk, D]) into one layer's cache kv at meta.slot_mapping."""
        d = kv.shape[4]
        rows = meta.kv_rows(kv.shape[2])
        flat = kv.view(2, -1, d)
        flat[0].index_copy_(0, rows, k.reshape(-1, d))
        flat[1].index_copy_(0, rows, v.reshape(-1, d))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] for the new tokens; kv: the layer's cache (see the module docstring).
        Writes k/v to the cache and returns the attention output [T, Hq * D]."""
        self.write_kv(k, v, kv, meta)
        if meta.is_decode_only:
            out = self._decode(q, kv, meta, scale, window)
        else:
            out = self._mixed(q, k, v, kv, meta, scale, window)
        return out.reshape(q.shape[0], -1)

    def _decode(self, q, kv, meta, scale, window):
        """One new token per sequence: gather each sequence's blocks into a padded batch [B, Hk, S, D].

        With one query per sequence, grouped-query attention is ordinary attention in which each KV head's
        group of query heads plays the role of the query length: [B, Hk, group, D] against [B, Hk, S, D].
        Two batched products and a softmax over contiguous K/V run about twice as fast on the CPU as
        scaled_dot_product_attention does for such short queries.
        """
        bs = meta.block_size
        max_len = max(meta.seq_lens)
        nblocks = -(-max_len // bs)
        b, hk, d = meta.num_seqs, kv.shape[2], kv.shape[4]
        keys, values = (_gather_blocks(kv[i], meta.block_tables[:, :nblocks])
                        .view(b, hk, nblocks * bs, d)[:, :, :max_len] for i in (0, 1))
        grouped = q.view(b, hk, q.shape[1] // hk, d)  # query heads of one KV head are adjacent
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scale)  # [B, Hk, group, S]
        scores.masked_fill_(meta.decode_hidden(window)[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)
        return out.reshape(b, q.shape[1], d)

    def _mixed(self, q, k, v, kv, meta, scale, window):
        """Prefill chunks (and decodes mixed with them): one attention call per sequence."""
        bs = meta.block_size
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            qlen, total = end - start, meta.seq_lens[i]
            if qlen == total:  # nothing cached before this step: the fresh k/v are the whole context
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                table = meta.block_tables[i, : -(-total // bs)]
                hk, d = kv.shape[2], kv.shape[4]
                keys, values = (_gather_blocks(kv[j], table).view(hk, -1, d)[:, :total] for j in (0, 1))
            mask = None
            causal = qlen > 1
            if qlen != total or window is not None:
                qpos = torch.arange(total - qlen, total, device=q.device)[:, None]
                kpos = torch.arange(total, device=q.device)[None, :]
                mask = kpos <= qpos
                if window is not None:
                    mask &= qpos - kpos < window
                causal = False
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys, values,
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
            ).transpose(0, 1)
        return out


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache: one layer's K or V [num_blocks, Hk, block_size, D]; block_ids: [..., n] block ids. Returns
    [..., Hk, n, block_size * D]: head h of block j at [..., h, j], so a view gives [..., Hk, n * block_size, D].
    F.embedding is a row gather that runs several times faster on the CPU than advanced indexing."""
    hk = cache.shape[1]
    rows = block_ids.unsqueeze(-2) * hk + torch.arange(hk, device=block_ids.device)[:, None]  # [..., Hk, n]
    return F.embedding(rows, cache.view(cache.shape[0] * hk, -1))
