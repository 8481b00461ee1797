"""Mixture-of-experts MLP (Mixtral, Qwen-MoE): a top-k softmax router, experts, an optional shared expert.

Routing follows the model's definition: softmax over every expert in float32, the top k, renormalized to sum 1
where the model says so (MoEConfig.renormalize). Each (token, k) pair is computed by its expert, scaled by its
routing weight, and the k results of a token are summed in k order.

With expert parallelism (ep > 1) the experts are spread over the EP group and attention is replicated, so every
EP index holds the same tokens. Each EP index routes its own 1/ep share of them, sends every (token, k) pair to
the index owning the expert (all-to-all dispatch), computes the pairs it receives, returns them (all-to-all
combine), sums its tokens' pairs, and an all-gather rebuilds the whole batch. Pairs reach an expert in global
token order whatever ep is, so an expert sees exactly the rows it would see in one process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.engine.model_config import MoEConfig
from tandem.engine.models.mlp import GatedMLP
from tandem.engine.parallel.layout import split_evenly


@dataclass
class MoEBlock:
    config: MoEConfig
    router: torch.Tensor  # [num_experts, hidden], replicated
    experts: dict[int, GatedMLP]  # this rank's experts (a TP share of each one's columns)
    expert_ranks: tuple[int, ...]  # EP index owning each expert
    shared: GatedMLP | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]
    comm: object | None = None  # ParallelComm when the replica spans processes
    ep_index: int = 0
    ep_size: int = 1
    load: Counter = field(default_factory=Counter)  # (token, k) pairs computed per expert, since start

    def __post_init__(self) -> None:
        self._owner = torch.tensor(self.expert_ranks, dtype=torch.int64, device=self.router.device)

    @property
    def nbytes(self) -> int:
        total = sum(e.nbytes for e in self.experts.values()) + self.router.numel() * self.router.element_size()
        return total + (self.shared.nbytes if self.shared else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden], complete (summed over TP and gathered over EP)."""
        if self.ep_size == 1:
            out = self._forward_tokens(x, dispatch=False)
            return self.comm.all_reduce_tp(out) if self.comm else out
        n, hidden = x.shape
        slices = split_evenly(n, self.ep_size)
        mine = slices[self.ep_index]
        out = self.comm.all_reduce_tp(self._forward_tokens(x[mine.start:mine.stop], dispatch=True))
        width = max(len(s) for s in slices)
        padded = x.new_zeros(width, hidden)
        padded[: len(mine)] = out
        gathered = self.comm.all_gather_ep(padded)
        return torch.cat([g[: len(s)] for g, s in zip(gathered, slices)])

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [n, k], routing weights [n, k])."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.config.weights_in_float else weights.to(x.dtype)

    def _forward_tokens(self, x: torch.Tensor, *, dispatch: bool) -> torch.Tensor:
        """This rank's share of the output for tokens x (a TP partial sum)."""
        n, hidden = x.shape
        k = self.config.top_k
        ids, weights = self._route(x)
        pair_ids = ids.reshape(-1)  # (token, k) pairs, token-major
        pair_tokens = torch.arange(n * k, device=x.device) // k
        if dispatch:
            pairs = self._dispatch(x, pair_ids, pair_tokens)
        else:
            pairs = self._run_experts(x[pair_tokens], pair_ids)
        out = (pairs * weights.reshape(-1, 1)).to(x.dtype).view(n, k, hidden).sum(dim=1)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out

    def _dispatch(self, x: torch.Tensor, pair_ids: torch.Tensor, pair_tokens: torch.Tensor) -> torch.Tensor:
        """Sends each pair to its expert's EP index and returns the computed pairs in the original order."""
        dest = self._owner[pair_ids]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        ones = [1] * self.ep_size
        self.comm.all_to_all_ep(recv_counts, send_counts, ones, ones)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        rows = x.new_empty(sum(recvs), x.shape[1])
        self.comm.all_to_all_ep(rows, x[pair_tokens[order]], recvs, sends)
        row_ids = pair_ids.new_empty(sum(recvs))
        self.comm.all_to_all_ep(row_ids, pair_ids[order], recvs, sends)
        computed = self._run_experts(rows, row_ids)
        back = x.new_empty(len(order), x.shape[1])
        self.comm.all_to_all_ep(back, computed, sends, recvs)
        pairs = torch.empty_like(back)
        pairs[order] = back
        return pairs

    def _run_experts(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """rows[i] through expert expert_ids[i] (each one of this rank's experts); rows of one expert are
        computed together, in the order given."""
        out = torch.empty_like(rows)
        if rows.shape[0] == 0:
            return out
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=self.config.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                idx = order[start:start + count]
                out[idx] = self.experts[expert](rows[idx])
                self.load[expert] += count
                start += count
        return out
