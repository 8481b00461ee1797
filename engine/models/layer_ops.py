"""What the model's layer loop calls for its weight products and attention (engine/models/llama.py run_layers):
plain calls, the custom ops a compiled step traces (engine/models/compiled.py), or either with LoRA adapters'
deltas added (engine/models/lora.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.engine.models.int4 import Int4Linear
from tandem.engine.models.int8 import Int8Linear
from tandem.engine.models.linear import Linear


class LayerOps(Protocol):
    """Plain calls (llama.py _EagerOps), the custom ops a compiled step traces (compiled.py CompiledOps), or LoRAOps
    over one of them."""

    def project(self, projection: Linear | Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor: ...

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...
