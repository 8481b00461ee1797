"""What the loaders return: a model without its weights (ModelInfo: config, tokenizer, source) and with them
(Checkpoint). Torch-free; the weight types are named for type checkers only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.engine.model_config import ModelConfig
from tandem.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from tandem.engine.loader.lazy_tensor import LazyTensor
    from tandem.engine.models.int4 import Int4Weight


@dataclass(frozen=True)
class ModelInfo:
    """A model's shape and tokenizer, read from `source` (a .gguf file or a Hugging Face folder) without its
    weights: what the router needs, and what a driver whose ranks load their own shards needs."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: Path


@dataclass
class Checkpoint:
    """A model with Hugging Face tensor names, before it is placed and repacked. The loaders give LazyTensor
    values (read on demand, only the slice a rank needs, straight into its device and dtype; they keep the
    files open), or Int4Weight for 4-bit GGUF projections loaded with packed=True, already in memory; callers
    may put float32 tensors in their place. Empty when only the config and tokenizer were read
    (load_checkpoint(weights=False))."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | Int4Weight | LazyTensor]
    tokenizer: Tokenizer
    source: Path
