"""From a path to a runnable model: read the checkpoint, then repack it for the device."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.loader.checkpoint import load_checkpoint
from tandem.engine.models import LlamaModel, build_model
from tandem.engine.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """model is None when only the config and tokenizer were read (weights=False): the ranks of a replica that
    spans processes load their own shards from `source`."""

    model: LlamaModel | None
    tokenizer: Tokenizer
    config: ModelConfig
    source: Path
    load_seconds: float
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")


def load_model(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", progress: bool = True, packed: bool = False,
               weights: bool = True) -> LoadedModel:
    """Loads weights and tokenizer from `path` (None: the embedded model). Raises ModelLoadError on bad input.

    packed: run a GGUF file's Q4_0/Q4_1 projections on the packed 4-bit kernel (needs dtype=torch.bfloat16).
    weights: False reads only the config and tokenizer (model is None).
    """
    start = time.perf_counter()
    checkpoint = load_checkpoint(path, progress=progress, packed=packed, weights=weights)
    model = None
    if weights:
        model = build_model(checkpoint.config, checkpoint.weights, dtype=dtype, device=device,
                            source=str(checkpoint.source))
    return LoadedModel(model=model, tokenizer=checkpoint.tokenizer, config=checkpoint.config,
                       source=checkpoint.source, load_seconds=time.perf_counter() - start, dtype=dtype,
                       device=torch.device(device))
