"""A model's config and tokenizer without its weights, and without torch: what the router needs (it counts and
hashes tokens, it never runs the model), and what a driver reads when its ranks load their own shards.

Only numpy, the `gguf` package, `tokenizers` and `jinja2` are imported here; tests/engine/loader/test_model_info.py
checks that importing this module and calling load_model_info() leaves torch out of the process.
"""

from __future__ import annotations

from pathlib import Path

from tandem.engine.errors import ModelLoadError
from tandem.engine.loader.checkpoint import ModelInfo
from tandem.engine.loader.embedded import default_model_path
from tandem.engine.loader.gguf_index import open_gguf
from tandem.engine.loader.gguf_metadata import gguf_model_info
from tandem.engine.loader.hf_metadata import hf_model_info

__all__ = ["ModelInfo", "load_model_info", "resolve_model_path"]


def resolve_model_path(path: str | Path | None) -> Path:
    """The file or folder a model path names (None: the embedded model's GGUF file, `~` expanded). Raises
    ModelLoadError if it does not exist."""
    source = default_model_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(f"model path {str(source)!r} does not exist")
    return source


def load_model_info(path: str | Path | None = None) -> ModelInfo:
    """Reads the config and tokenizer of `path` (a Hugging Face folder or a .gguf file; None: the embedded
    model); no weight is read. Raises ModelLoadError with a message naming the path and the problem
    (UnsupportedModelError for a model tandem cannot run)."""
    source = resolve_model_path(path)
    if source.is_dir():
        return hf_model_info(source)
    return gguf_model_info(open_gguf(source), source)
