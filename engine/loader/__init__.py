"""Loads a model from a Hugging Face folder or a GGUF file (default: the embedded SmolLM2-135M-Instruct GGUF).

  model_info.py    config and tokenizer only, torch-free (gguf_index.py + gguf_metadata.py, hf_metadata.py): for the
                   router; gguf_index.py parses a GGUF file once per version of it and caches the result
  model_loader.py  load_checkpoint (the format's weight loader: gguf_file.py, hf_folder.py) and load_model

The names below are imported on first use (PEP 562), so that importing the torch-free part of this package
does not import model_loader and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engine.loader.checkpoint import Checkpoint, ModelInfo
    from tandem.engine.loader.embedded import default_model_path
    from tandem.engine.loader.model_info import load_model_info
    from tandem.engine.loader.model_loader import LoadedModel, load_checkpoint, load_model

_HOMES = {"Checkpoint": "checkpoint", "ModelInfo": "checkpoint", "default_model_path": "embedded",
          "load_model_info": "model_info", "LoadedModel": "model_loader", "load_checkpoint": "model_loader",
          "load_model": "model_loader"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
