"""The SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.models.int4 import Int4Linear
from tandem.engine.models.linear import Linear


@dataclass
class GatedMLP:
    """With tensor parallelism each rank holds a share of the intermediate columns, so its output is a partial
    sum that the caller all-reduces over the TP group."""

    gate_up: Linear | Int4Linear  # [hidden] -> [2 * columns]: gate, then up
    down: Linear | Int4Linear  # [columns] -> [hidden]

    def __call__(self, x: torch.Tensor, project=None) -> torch.Tensor:
        """project(projection, x): how a product runs (default: calling it; a compiled step passes its op)."""
        project = project or _call
        gate, up = project(self.gate_up, x).chunk(2, dim=-1)
        return project(self.down, F.silu(gate) * up)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def _call(projection: Linear | Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return projection(x)
