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
    """A model on the CPU, with Hugging Face tensor names, before it is placed and repacked. Weights are float32
    tensors, or Int4Weight for 4-bit GGUF projections loaded with packed=True; empty when only the config and
    tokenizer were read (load_checkpoint(weights=False))."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | Int4Weight]
    tokenizer: Tokenizer
    source: Path
