"""The torch reference attention backend: writes K/V into paged blocks and reads them back through block tables.

It is the correctness baseline (CPU, tests) that the Triton kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    """Stateless; one instance serves every layer."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        """Stores new K/V ([T, Hk, D]) into one layer's cache kv ([2, num_blocks, block_size, Hk, D], K at 0 and
        V at 1) at meta.slot_mapping."""
        flat = kv.view(2, -1, k.shape[1] * k.shape[2])
        flat[0].index_copy_(0, meta.slot_mapping, k.reshape(k.shape[0], -1))
        flat[1].index_copy_(0, meta.slot_mapping, v.reshape(v.shape[0], -1))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] for the new tokens; kv: the layer's cache (see write_kv).
        Writes k/v to the cache and returns the attention output [T, Hq * D]."""
        self.write_kv(k, v, kv, meta)
        if meta.is_decode_only:
            out = self._decode(q, kv, meta, scale, window)
        else:
            out = self._mixed(q, k, v, kv, meta, scale, window)
        return out.reshape(q.shape[0], -1)

    def _decode(self, q, kv, meta, scale, window):
        """One new token per sequence: gather each sequence's blocks into a padded batch.

        With one query per sequence, grouped-query attention is ordinary attention in which each KV head's
        group of query heads plays the role of the query length: [B, Hk, group, D] against [B, Hk, S, D].
        That form avoids SDPA's enable_gqa path, which is several times slower in bfloat16 on the CPU.
        """
        bs = meta.block_size
        max_len = max(meta.seq_lens)
        nblocks = -(-max_len // bs)
        b, hk, d = meta.num_seqs, kv.shape[3], kv.shape[4]
        keys, values = (_gather_blocks(kv[i], meta.block_tables[:, :nblocks])
                        .view(b, nblocks * bs, hk, d)[:, :max_len].transpose(1, 2) for i in (0, 1))
        mask = None
        if b > 1 or window is not None:
            kpos = torch.arange(max_len, device=q.device)
            qpos = meta.seq_lens_tensor[:, None] - 1
            visible = kpos[None, :] <= qpos
            if window is not None:
                visible &= qpos - kpos[None, :] < window
            mask = visible[:, None, None, :]
        grouped = q.view(b, hk, q.shape[1] // hk, d)  # query heads of one KV head are adjacent
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(b, q.shape[1], d)

    def _mixed(self, q, k, v, kv, meta, scale, window):
        """Prefill chunks (and decodes mixed with them): one attention call per sequence."""
        bs = meta.block_size
        hk, d = k.shape[1], k.shape[2]
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            qlen, total = end - start, meta.seq_lens[i]
            if qlen == total:  # nothing cached before this step: the fresh k/v are the whole context
                keys, values = k[start:end], v[start:end]
            else:
                table = meta.block_tables[i, : -(-total // bs)]
                keys, values = (_gather_blocks(kv[j], table).view(-1, hk, d)[:total] for j in (0, 1))
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
                q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
            ).transpose(0, 1)
        return out


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache: one layer's K or V [num_blocks, block_size, Hk, D]; returns the blocks named by block_ids (any
    shape) as rows [*block_ids.shape, block_size * Hk * D]. F.embedding is a row gather that runs several times
    faster on the CPU than advanced indexing or index_select over the same rows."""
    return F.embedding(block_ids, cache.view(cache.shape[0], -1))
