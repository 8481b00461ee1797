"""Hugging Face folders: one or many `*.safetensors` read as float32 tensors. The config and tokenizer are read
by hf_metadata.py."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tandem.engine.errors import ModelLoadError
from tandem.engine.loader.checkpoint import Checkpoint
from tandem.engine.loader.hf_metadata import hf_model_info
from tandem.engine.loader.progress import progress_bar
from tandem.engine.model_config import read_json_file


def shard_files(folder: Path) -> list[Path]:
    """The folder's safetensors files, from model.safetensors.index.json when present. Raises ModelLoadError
    if a listed shard is missing or there is none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json_file(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard {missing[0]!r} listed in {index.name} is missing")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found (other weight formats are not supported)")
    return files


def load_hf_folder(folder: Path, *, progress: bool = True) -> Checkpoint:
    """Config, tokenizer and every tensor of a Hugging Face folder. Raises ModelLoadError naming the file."""
    info = hf_model_info(folder)
    handles = []
    shards = shard_files(folder)
    for shard in shards:
        try:
            handles.append(safe_open(str(shard), framework="pt"))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{shard}: cannot be read as safetensors (truncated or corrupt?): {e}") from None
    keys = [(h, k, s) for h, s in zip(handles, shards) for k in h.keys()]
    tensors: dict[str, torch.Tensor] = {}
    for handle, key, shard in progress_bar(keys, len(keys), f"loading {folder.name}", progress):
        try:
            tensors[key] = handle.get_tensor(key).to(torch.float32)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{shard}: tensor {key!r} cannot be read: {e}") from None
    return Checkpoint(config=info.config, weights=tensors, tokenizer=info.tokenizer, source=folder)
