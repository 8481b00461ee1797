"""LoRA adapters applied unmerged, many in one batch: each projection's output gains, for the rows of each adapter,
(x A^T) B^T scaled, beside the base product (as Punica and S-LoRA serve them). The base weights never change, so
requests of several adapters and of the base model share every step.

LoRASlots holds one rank's part of `slots` adapters in preallocated tensors, per layer, fused projection (QKV, O,
gate-up, down) and target: A and B transposed, [slots, in, max_rank] and [slots, max_rank, out rows], an adapter of
rank r taking the first r of them, its scaling folded into B. Tensor parallelism: a column-parallel projection
(QKV, gate-up) holds all of A and its rows of B, a row-parallel one (O, down) its columns of A and all of B, so its
delta is a partial sum that the TP all-reduce adds up with the base product's. MoE experts carry no adapters.

Each step, LoRAPool.use() maps the batch's rows to slots (loading adapters into slots, least recently used out
first) and the model's layer loop runs its products through LoRAOps while any row has an adapter. The runner
orders a step's rows by adapter, so each adapter's rows are one run: equal runs (a decode batch spread evenly)
take two batched products per target for every adapter at once, runs of other lengths (prefill chunks) a product
pair each, and rows in any other order are gathered and scattered. These are torch products on the CPU and on
CUDA alike (a dedicated Triton kernel is not written yet).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from tandem.engine.models.layer_ops import LayerOps

_log = logging.getLogger(__name__)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter as read (engine/loader/lora_adapter.py): float32 on the CPU, whole (not sharded).
    modules: (global layer index, target) -> (A [rank, in], B [out, rank])."""

    name: str
    rank: int
    scaling: float
    modules: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Part:
    """One target of a fused projection: its adapters' A and B (transposed, so that x @ a[slot] @ b[slot] is the
    delta; B scaled) and where it sits in the projection and in the checkpoint."""

    target: str
    out_rows: slice  # this rank's output rows of the fused projection that the target fills
    rows: range | None  # the target's global output rows this rank holds (None: all)
    columns: range | None  # the target's global input columns this rank holds (None: all)
    a: torch.Tensor  # [slots, in, max_rank]
    b: torch.Tensor  # [slots, max_rank, out rows]


@dataclass
class _Site:
    """One fused projection of one layer and its targets."""

    layer: int  # global layer index
    parts: tuple[_Part, ...]


class LoRASlots:
    """`slots` adapters of rank up to max_rank for the part of the model (engine/models/llama.py LlamaModel) this rank
    holds (see the module doc). Raises ValueError for an adapter of a higher rank."""

    def __init__(self, model, slots: int, max_rank: int):
        from tandem.engine.models.mlp import GatedMLP
        from tandem.engine.parallel.layout import split_evenly

        self.slots, self.max_rank = slots, max_rank
        self.ranks = [0] * slots  # the rank of each slot's adapter (0: empty)
        self._sites: dict[int, _Site] = {}  # id(projection) -> its site
        cfg, shard, d = model.config, model.shard, model.config.head_dim
        tp = 1 if model.comm is None else model.comm.tp_size
        q_rows = None if tp == 1 else range(shard.q_heads.start * d, shard.q_heads.stop * d)
        kv_rows = None if tp == 1 else range(shard.kv_heads.start * d, shard.kv_heads.stop * d)
        q, kv = model.num_heads * d, model.num_kv_heads * d

        def part(projection, target: str, out_rows: slice, rows: range | None, columns: range | None) -> _Part:
            size = len(range(projection.out_features)[out_rows])
            return _Part(target, out_rows, rows, columns,
                         torch.zeros(slots, projection.in_features, max_rank, dtype=model.dtype, device=model.device),
                         torch.zeros(slots, max_rank, size, dtype=model.dtype, device=model.device))

        for index, layer in enumerate(model.layers):
            n, qkv, o = shard.layers[index], layer.qkv, layer.o
            self._sites[id(qkv)] = _Site(n, (part(qkv, "q_proj", slice(0, q), q_rows, None),
                                             part(qkv, "k_proj", slice(q, q + kv), kv_rows, None),
                                             part(qkv, "v_proj", slice(q + kv, q + 2 * kv), kv_rows, None)))
            self._sites[id(o)] = _Site(n, (part(o, "o_proj", slice(None), None, q_rows),))
            if isinstance(layer.mlp, GatedMLP):
                cols, gate_up, down = layer.mlp.down.in_features, layer.mlp.gate_up, layer.mlp.down
                split = None if tp == 1 else split_evenly(cfg.intermediate_size, tp)[shard.tp_index]
                self._sites[id(gate_up)] = _Site(n, (part(gate_up, "gate_proj", slice(0, cols), split, None),
                                                     part(gate_up, "up_proj", slice(cols, 2 * cols), split, None)))
                self._sites[id(down)] = _Site(n, (part(down, "down_proj", slice(None), None, split),))
        self._plan: _Plan | None = None
        _log.info("LoRA pool: %d adapters of rank <= %d, %.1f MiB on %s", slots, max_rank, self.nbytes / 2**20,
                  model.device)

    @property
    def active(self) -> bool:
        """Whether this step has rows with an adapter."""
        return self._plan is not None

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                   for site in self._sites.values() for p in site.parts)

    def load(self, slot: int, adapter: LoRAWeights) -> None:
        """Writes this rank's part of `adapter` into `slot` (what was there is gone)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over max_rank {self.max_rank}")
        r = adapter.rank
        for site in self._sites.values():
            for part in site.parts:
                part.a[slot].zero_()
                part.b[slot].zero_()
                pair = adapter.modules.get((site.layer, part.target))
                if pair is None:
                    continue
                a, b = pair
                if part.columns is not None:
                    a = a[:, part.columns.start:part.columns.stop]
                if part.rows is not None:
                    b = b[part.rows.start:part.rows.stop]
                part.a[slot, :, :r] = a.T.to(part.a.dtype)
                part.b[slot, :r] = (b * adapter.scaling).T.to(part.b.dtype)
        self.ranks[slot] = r

    def set_rows(self, runs: Sequence[tuple[int, int]]) -> None:
        """This step's rows as runs of (slot, rows), in row order (slot -1: the base model's); clear() undoes it.
        The rows are grouped by slot once here, so that each projection then runs two batched products over every
        group at once, or one pair per group."""
        groups: dict[int, list[range]] = {}
        start = 0
        for slot, length in runs:
            if slot >= 0 and length:
                groups.setdefault(slot, []).append(range(start, start + length))
            start += length
        if not groups:
            self._plan = None
            return
        device = next(iter(self._sites.values())).parts[0].a.device
        slots = sorted(groups)
        rank = max(self.ranks[slot] for slot in slots)
        contiguous_slots = slots == list(range(len(slots)))  # as the pool fills them: a[:groups] is theirs
        spans = [(r[0].start, r[-1].stop) if all(x.stop == y.start for x, y in zip(r, r[1:])) else None
                 for r in (groups[slot] for slot in slots)]
        if None not in spans:  # each adapter's rows side by side (the runner orders them so)
            n = spans[0][1] - spans[0][0]
            if contiguous_slots and all(b - a == n for a, b in spans) and \
                    all(y[0] == x[1] for x, y in zip(spans, spans[1:])):
                self._plan = _Plan(slots, None, rank, slice(spans[0][0], spans[-1][1]), None, None)
            else:
                self._plan = _Plan(slots, None, rank, [slice(a, b) for a, b in spans], None, None)
            return
        rows = [[i for r in groups[slot] for i in r] for slot in slots]
        n = max(len(r) for r in rows)  # groups padded to n rows (repeating their first row)
        index = torch.tensor([r + r[:1] * (n - len(r)) for r in rows], device=device)
        valid = torch.tensor([[i < len(r) for i in range(n)] for r in rows], device=device).flatten()
        stacked = None if contiguous_slots else torch.tensor(slots, device=device)
        self._plan = _Plan(slots, stacked, rank, index, valid, index.flatten()[valid])

    def clear(self) -> None:
        self._plan = None

    def add(self, projection, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (= projection(x)) with each adapter's delta added on its rows, in place: per target, two batched
        products over every group of rows at once (a lower-rank adapter's columns past its rank are zeros)."""
        site, plan = self._sites.get(id(projection)), self._plan
        if site is None or plan is None:
            return out
        if isinstance(plan.rows, list):  # one run of rows per adapter, of different lengths or slots
            for slot, rows in zip(plan.slots, plan.rows):
                xs = x[rows]
                for part in site.parts:  # a contiguous product, added into the strided columns
                    out[rows, part.out_rows] += (xs @ part.a[slot, :, :plan.rank]) @ part.b[slot, :plan.rank]
            return out
        if isinstance(plan.rows, slice):  # equal runs of rows side by side, slots 0..groups-1 in order
            rows = x[plan.rows]
            rows = rows.view(len(plan.slots), -1, rows.shape[-1])
        else:
            rows = x[plan.rows]  # [groups, n, in], padded
        groups = len(plan.slots)
        for part in site.parts:
            a = part.a[:groups] if plan.stacked is None else part.a.index_select(0, plan.stacked)
            b = part.b[:groups] if plan.stacked is None else part.b.index_select(0, plan.stacked)
            h = torch.bmm(rows, a[:, :, :plan.rank])  # [groups, n, rank]
            if isinstance(plan.rows, slice):  # added in place: out's rows seen as [groups, n, out rows]
                target = out[plan.rows, part.out_rows]
                target.view(groups, -1, target.shape[-1]).baddbmm_(h, b[:, :plan.rank])
            else:
                delta = torch.bmm(h, b[:, :plan.rank])  # [groups, n, out rows]
                out[:, part.out_rows].index_add_(0, plan.targets, delta.reshape(-1, delta.shape[-1])[plan.valid])
        return out


@dataclass(frozen=True)
class _Plan:
    """One step's rows by adapter: the slots (in order), the index that stacks their A and B for a batched product
    when they are not slots 0..groups-1 (None: they are), the highest rank among them, and the rows: one slice
    (equal runs, one per slot, side by side), a slice per slot (runs of any length or slots in any order), or rows
    [groups, n] (padded) with which of them are real (flat) and those."""

    slots: list[int]
    stacked: torch.Tensor | None
    rank: int
    rows: slice | list[slice] | torch.Tensor
    valid: torch.Tensor | None
    targets: torch.Tensor | None


@dataclass(frozen=True)
class LoRAOps:
    """The layer loop's ops (layer_ops.py) with each weight product's adapter deltas added."""

    inner: LayerOps
    slots: LoRASlots

    def project(self, projection, x: torch.Tensor) -> torch.Tensor:
        return self.slots.add(projection, x, self.inner.project(projection, x))

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner.attend(index, q, k, v)


class LoRAPool:
    """Which adapter is in which slot, for one rank: adapters known by name (read on first use), loaded into a
    slot when a step needs them, the least recently used unneeded one leaving first. read(name) reads one."""

    def __init__(self, slots: LoRASlots, read):
        self.slots = slots
        self._read = read
        self._in_slot: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.loads = 0

    def forget(self, name: str) -> None:
        """The adapter leaves its slot (unloaded, or its file replaced)."""
        slot = self._in_slot.pop(name, None)
        if slot is not None:
            self.slots.ranks[slot] = 0

    def use(self, adapters: Sequence[str | None], lengths: Sequence[int]) -> None:
        """Puts every adapter the batch's chunks name (adapters[i]: chunk i's, None for the base model; lengths[i]:
        its rows) in a slot and maps the rows to them. Raises ValueError when they are more than the slots (the
        scheduler keeps a step within lora.max_loaded)."""
        names = list(dict.fromkeys(a for a in adapters if a is not None))
        if not names:
            self.slots.clear()
            return
        if len(names) > self.slots.slots:
            raise ValueError(f"a step needs {len(names)} LoRA adapters but the pool holds {self.slots.slots}")
        for name in names:
            if name in self._in_slot:
                self._in_slot.move_to_end(name)
                continue
            used = set(self._in_slot.values())
            free = next((s for s in range(self.slots.slots) if s not in used), None)
            if free is None:
                victim = next(n for n in self._in_slot if n not in names)
                free = self._in_slot.pop(victim)
            self.slots.load(free, self._read(name))
            self._in_slot[name] = free
            self.loads += 1
        self.slots.set_rows([(-1 if a is None else self._in_slot[a], n) for a, n in zip(adapters, lengths)])
