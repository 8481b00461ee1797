"""Hugging Face folders: `config.json`, one or many `*.safetensors`, `tokenizer.json` and its config."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tandem.engine.config import model_config_from_hf, read_json_file
from tandem.engine.errors import ModelLoadError
from tandem.engine.loader.checkpoint import Checkpoint
from tandem.engine.loader.progress import progress_bar
from tandem.engine.tokenizer import Tokenizer


def _shard_files(folder: Path) -> list[Path]:
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


def load_hf_folder(folder: Path, *, progress: bool = True, weights: bool = True) -> Checkpoint:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: config.json is missing; is this a Hugging Face model folder?")
    raw = read_json_file(config_path)
    generation = folder / "generation_config.json"
    if generation.is_file() and "eos_token_id" in (gen := read_json_file(generation)):
        raw = raw | {"eos_token_id": gen["eos_token_id"]}
    config = model_config_from_hf(raw)
    tokenizer = Tokenizer.from_folder(folder, eos_token_ids=config.eos_token_ids)

    tensors: dict[str, torch.Tensor] = {}
    shards = _shard_files(folder)
    if not weights:
        return Checkpoint(config=config, weights=tensors, tokenizer=tokenizer, source=folder)
    handles = []
    for shard in shards:
        try:
            handles.append(safe_open(str(shard), framework="pt"))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{shard}: cannot be read as safetensors (truncated or corrupt?): {e}") from None
    keys = [(h, k, s) for h, s in zip(handles, shards) for k in h.keys()]
    for handle, key, shard in progress_bar(keys, len(keys), f"loading {folder.name}", progress):
        try:
            tensors[key] = handle.get_tensor(key).to(torch.float32)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{shard}: tensor {key!r} cannot be read: {e}") from None
    return Checkpoint(config=config, weights=tensors, tokenizer=tokenizer, source=folder)
