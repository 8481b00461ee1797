"""Dummy weights (`load_format: dummy`): a model of any published shape without its weight files, for measuring
speed and memory at the sizes users run (performance does not depend on the weights' values; vLLM's
`--load-format dummy` is the same idea).

Every tensor the config implies is a DummyTensor: a LazyTensor-like value whose read() makes just the rows and
columns asked for, on the rank's device, in its dtype. Nothing is read from disk and no whole tensor is ever made
on the host, so each rank of a TP/PP/EP replica builds only its own shard, on its GPU.

Values. One pool of 2**22 uniform values per seed and device (ValuePool: a 32-bit integer hash of each index, exact
in int64 on any device) holds every value; row r of tensor `name` is the run of the pool that starts at a hash of
(seed, name, r), so element (r, c) is pool[start(r) + c]. A shard is thus exactly the matching slice of the whole
tensor (a model split over ranks computes what the unsplit model computes), the same seed always gives the same
model, and a row is made by one contiguous copy: about 200 M values/s on 2 CPU cores (hashing every element ran at
25 M/s, 50 s for a 1B model). Rows share the pool's values at different offsets, which is noise to a benchmark.

Scale (activations stay finite through every layer, logits neither constant nor huge):
- RMSNorm weights are ones and biases zeros;
- every other matrix [out, in] is uniform with standard deviation 1/sqrt(in), so a unit-RMS input gives unit-scale
  outputs (the embedding [vocab, hidden] too, which keeps a tied LM head's logits near unit scale);
- the products that add into the residual stream (o_proj, down_proj / w2) are further scaled by 1/sqrt(2 * layers)
  (GPT-2's initialisation), so the residual stream grows slowly with depth.
"""

from __future__ import annotations

import math
import zlib

import torch

from tandem.engine.loader.checkpoint import Checkpoint, ModelInfo
from tandem.engine.loader.lazy_tensor import check_range
from tandem.engine.model_config import ModelConfig

_M32 = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x5BD1E995)  # odd multipliers below 2**31: a 32-bit value times one stays below 2**63
POOL_SIZE = 1 << 22  # values per pool; rows are runs of it, so at most this many columns
CHUNK_ELEMENTS = 1 << 24  # values made per pass: bounds the temporaries (float32, before the cast to dtype)
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight", ".w2.weight")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of x (int64 values in 0..2**32-1), in place."""
    x ^= x >> 16
    x.mul_(_MIX[0]).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_MIX[1]).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def _hashed(values: torch.Tensor, key: int) -> torch.Tensor:
    """The hash of each (key, value) pair, values int64 >= 0: int64 in 0..2**32-1."""
    return _mix(values.add(key).bitwise_and_(_M32))


class ValuePool:
    """The values every DummyTensor of one model copies its rows from: POOL_SIZE uniform values in [-1, 1) made
    from the seed, once per device, stored twice over so that a run never wraps."""

    def __init__(self, seed: int):
        self.key = zlib.crc32(f"pool:{seed}".encode()) & _M32
        self._on: dict[str, torch.Tensor] = {}

    def runs(self, device: torch.device | str, width: int) -> torch.Tensor:
        """[POOL_SIZE, width] (a view): row i is the run of `width` values starting at pool index i."""
        if width > POOL_SIZE:
            raise ValueError(f"dummy weights have rows of at most {POOL_SIZE} values, not {width}")
        name = str(torch.device(device))
        if name not in self._on:
            index = torch.arange(POOL_SIZE, dtype=torch.int64, device=device)
            values = _hashed(index, self.key).to(torch.float32).mul_(2.0 / 2**32).sub_(1.0)
            self._on[name] = torch.cat([values, values])
        return self._on[name].unfold(0, width, 1)


def tensor_scale(name: str, shape: tuple[int, ...], num_layers: int) -> float | None:
    """The half-width of the uniform values of tensor `name` (uniform on [-a, a] has standard deviation a/sqrt(3));
    None for a tensor of constant value (norms: ones, biases: zeros; see constant_value)."""
    if len(shape) == 1:
        return None
    std = 1.0 / math.sqrt(shape[1])
    if name.endswith(_RESIDUAL_WRITERS):
        std /= math.sqrt(2 * max(1, num_layers))
    return std * math.sqrt(3.0)


def constant_value(name: str) -> float:
    """What a 1-D tensor holds: ones for a norm's weight, zeros for a bias."""
    return 0.0 if name.endswith(".bias") else 1.0


class DummyTensor:
    """A tensor of the model made where it is read (engine/models/projections.py's LazyWeight: shape and read()).
    Its rows are runs of `pool` at offsets fixed by the pool's seed and `name`; num_layers fixes its scale (see the
    module docstring)."""

    def __init__(self, shape: tuple[int, ...], name: str, *, pool: ValuePool, num_layers: int):
        self.shape = tuple(shape)
        self.name = name
        self.pool = pool
        self.scale = tensor_scale(name, self.shape, num_layers)
        self.key = zlib.crc32(name.encode()) ^ pool.key

    def read(self, rows: range | None = None, columns: range | None = None, *, dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor:
        """The rows (dim 0) and columns (dim 1) asked for (None: all), made on `device` as `dtype`: exactly that
        slice of the whole tensor. Raises ValueError for a range outside the shape."""
        rows = _as_range(check_range(rows, self.shape[0], "rows", self.name))
        if len(self.shape) == 1:
            if columns is not None:
                raise ValueError(f"{self.name}: columns asked of a 1-D tensor")
            return torch.full((len(rows),), constant_value(self.name), dtype=dtype, device=device)
        columns = _as_range(check_range(columns, self.shape[1], "columns", self.name))
        out = torch.empty(len(rows), len(columns), dtype=dtype, device=device)
        runs = self.pool.runs(device, len(columns))
        index = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device)
        starts = _hashed(index, self.key).remainder_(POOL_SIZE).add_(columns.start)
        step = max(1, CHUNK_ELEMENTS // max(1, len(columns)))
        for first in range(0, len(rows), step):
            part = runs.index_select(0, starts[first:first + step])
            out[first:first + step] = part.mul_(self.scale)
        return out


def _as_range(part: slice) -> range:
    return range(part.start, part.stop)


def dummy_weights(config: ModelConfig, *, seed: int = 0) -> dict[str, DummyTensor]:
    """A DummyTensor for every tensor the config implies (engine/models/llama.py expected_shapes)."""
    from tandem.engine.models.llama import expected_shapes

    pool = ValuePool(seed)
    return {name: DummyTensor(shape, name, pool=pool, num_layers=config.num_layers)
            for name, shape in expected_shapes(config).items()}


def dummy_checkpoint(info: ModelInfo, *, seed: int = 0) -> Checkpoint:
    """The checkpoint of info's model (its config and tokenizer) with dummy weights."""
    return Checkpoint(config=info.config, weights=dummy_weights(info.config, seed=seed), tokenizer=info.tokenizer,
                      source=info.source)
