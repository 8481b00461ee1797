"""Which rank of one replica holds which layers, KV heads, query heads, MLP columns and experts.

A replica of shape `tp x pp x ep` has tp * pp * ep ranks. Rank r sits at (stage, ep_index, tp_index) with
r = (stage * ep + ep_index) * tp + tp_index, so the tp ranks of one EP slot are neighbours and a whole stage is
one contiguous run of ranks.

- Pipeline (pp): stage s holds a contiguous run of layers (even by default: earlier stages take the extra
  layers; or an explicit count per stage).
- Tensor (tp): attention is split by KV-head groups. With tp <= num_kv_heads each rank holds a contiguous run
  of KV heads and exactly the query heads that read them, so the SmolLM2 shape (9 query heads, 3 KV heads)
  splits 6+3 at tp=2. With tp > num_kv_heads the query heads are split instead and each rank keeps the KV heads
  its query heads read (a KV head is then stored on more than one rank). MLP and expert weights are split by
  columns (gate/up) and rows (down), again as evenly as sizes allow; partial sums are all-reduced.
- Expert (ep): each expert lives on one EP index (contiguous runs by default, or an explicit map). Attention
  is replicated across EP indices (tensor-parallel inside each), so every rank of a stage with the same
  tp_index holds the same KV heads.

Plain Python with no tensors: kv_transfer and the router read it to re-shard KV between replicas.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(total: int, parts: int) -> tuple[range, ...]:
    """Contiguous ranges covering range(total), sizes differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        ranges.append(range(start, start + size))
        start += size
    return tuple(ranges)


@dataclass(frozen=True)
class ParallelConfig:
    """How one replica is split. stage_layers: layers per pipeline stage (default: even). expert_ranks: the
    EP index owning each expert (default: contiguous runs). collective_timeout_s bounds every collective and
    send, so a dead rank makes the others fail instead of hang."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    stage_layers: tuple[int, ...] | None = None
    expert_ranks: tuple[int, ...] | None = None
    micro_batches: int | None = None  # per step with pp > 1 (default: 2 * pp)
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be positive, got {self.collective_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches or (2 * self.pp if self.pp > 1 else 1)


@dataclass(frozen=True)
class RankShard:
    """What one rank holds. Ranges index the full model's layers, heads, columns and experts."""

    rank: int
    stage: int
    ep_index: int
    tp_index: int
    layers: range
    q_heads: range
    kv_heads: range
    experts: tuple[int, ...]
    is_first_stage: bool
    is_last_stage: bool


@dataclass(frozen=True)
class ReplicaLayout:
    """The shape of one replica over a model. Build with ReplicaLayout.build; raises ValueError with a message
    for a split the model cannot take."""

    tp: int
    pp: int
    ep: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    stage_layers: tuple[range, ...]
    expert_ranks: tuple[int, ...]

    @classmethod
    def build(cls, parallel: ParallelConfig, *, num_layers: int, num_heads: int, num_kv_heads: int,
              num_experts: int = 0) -> ReplicaLayout:
        tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
        if tp > num_heads:
            raise ValueError(f"tp={tp} is more than the model's {num_heads} attention heads")
        if pp > num_layers:
            raise ValueError(f"pp={pp} is more than the model's {num_layers} layers")
        if ep > 1 and num_experts == 0:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model; this model has no experts")
        if ep > max(num_experts, 1):
            raise ValueError(f"ep={ep} is more than the model's {num_experts} experts")
        if parallel.stage_layers is None:
            stages = split_evenly(num_layers, pp)
        else:
            counts = tuple(parallel.stage_layers)
            if len(counts) != pp or any(c < 1 for c in counts) or sum(counts) != num_layers:
                raise ValueError(f"stage_layers {list(counts)} must be {pp} positive counts summing to the "
                                 f"model's {num_layers} layers")
            starts = [sum(counts[:i]) for i in range(pp)]
            stages = tuple(range(s, s + c) for s, c in zip(starts, counts))
        if parallel.expert_ranks is None:
            owners = tuple(i for i, r in enumerate(split_evenly(num_experts, ep)) for _ in r)
        else:
            owners = tuple(parallel.expert_ranks)
            if len(owners) != num_experts or any(not 0 <= o < ep for o in owners):
                raise ValueError(f"expert_ranks must give an EP index in 0..{ep - 1} for each of the "
                                 f"{num_experts} experts, got {list(owners)}")
            idle = sorted(set(range(ep)) - set(owners))
            if idle:
                raise ValueError(f"expert_ranks leaves EP index {idle[0]} without experts")
        layout = cls(tp, pp, ep, num_layers, num_heads, num_kv_heads, num_experts, stages, owners)
        group = num_heads // num_kv_heads
        for t in range(tp):
            q, kv = layout.heads(t)
            per_kv = {sum(1 for h in q if h // group == k) for k in kv}
            if len(per_kv) != 1:
                raise ValueError(f"tp={tp} gives rank {t} query heads {q.start}-{q.stop - 1}, which read KV heads "
                                 f"{kv.start}-{kv.stop - 1} unequally; use tp <= {num_kv_heads} (the KV heads) "
                                 f"or a tp that divides {num_heads}")
        return layout

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep

    def rank(self, stage: int, ep_index: int, tp_index: int) -> int:
        return (stage * self.ep + ep_index) * self.tp + tp_index

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, ep_index, tp_index) of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the replica's {self.world_size} ranks")
        slot, tp_index = divmod(rank, self.tp)
        stage, ep_index = divmod(slot, self.ep)
        return stage, ep_index, tp_index

    def heads(self, tp_index: int) -> tuple[range, range]:
        """(query heads, KV heads) held by tp_index."""
        group = self.num_heads // self.num_kv_heads
        if self.tp <= self.num_kv_heads:
            kv = split_evenly(self.num_kv_heads, self.tp)[tp_index]
            return range(kv.start * group, kv.stop * group), kv
        q = split_evenly(self.num_heads, self.tp)[tp_index]
        return q, range(q.start // group, (q.stop - 1) // group + 1)

    def columns(self, size: int, tp_index: int) -> range:
        """The share of an MLP's `size` intermediate columns held by tp_index."""
        return split_evenly(size, self.tp)[tp_index]

    def experts(self, ep_index: int) -> tuple[int, ...]:
        return tuple(e for e, owner in enumerate(self.expert_ranks) if owner == ep_index)

    def shard(self, rank: int) -> RankShard:
        stage, ep_index, tp_index = self.coords(rank)
        q, kv = self.heads(tp_index)
        return RankShard(rank, stage, ep_index, tp_index, self.stage_layers[stage], q, kv, self.experts(ep_index),
                         stage == 0, stage == self.pp - 1)

    def tp_group(self, stage: int, ep_index: int) -> tuple[int, ...]:
        return tuple(self.rank(stage, ep_index, t) for t in range(self.tp))

    def ep_group(self, stage: int, tp_index: int) -> tuple[int, ...]:
        return tuple(self.rank(stage, e, tp_index) for e in range(self.ep))

    @property
    def sampler_rank(self) -> int:
        """The rank that computes logits and samples: the last stage's first rank."""
        return self.rank(self.pp - 1, 0, 0)

    def describe(self) -> list[str]:
        """One line per rank: what it holds (for logs and `tandem generate --verbose`)."""
        lines = []
        for r in range(self.world_size):
            s = self.shard(r)
            experts = f", experts {list(s.experts)}" if self.num_experts else ""
            lines.append(f"rank {r}: stage {s.stage} layers {s.layers.start}-{s.layers.stop - 1}, tp {s.tp_index} "
                         f"KV heads {s.kv_heads.start}-{s.kv_heads.stop - 1} (query heads {s.q_heads.start}-"
                         f"{s.q_heads.stop - 1}), ep {s.ep_index}{experts}")
        return lines
