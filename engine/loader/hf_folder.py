"""Hugging Face folders: one or many `*.safetensors`, indexed without reading their data. Each tensor is a
LazyTensor that reads just the slice a rank asks for, in the file's dtype (safetensors' `get_slice`). The
config and tokenizer are read by hf_metadata.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tandem.engine.errors import ModelLoadError
from tandem.engine.loader.checkpoint import Checkpoint
from tandem.engine.loader.hf_metadata import hf_model_info
from tandem.engine.loader.lazy_tensor import LazyTensor
from tandem.engine.loader.progress import progress_bar
from tandem.engine.loader.published_models import MADE_BY
from tandem.engine.model_config import read_json_file

_READ_ERRORS = (SafetensorError, OSError, RuntimeError, ValueError)


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
    if not files and (folder / MADE_BY).is_file():
        raise ModelLoadError(f"{folder}: has no weights (`tandem make-model --like` wrote only its shape): load it "
                             "with dummy weights (--load-format dummy, or the manifest's engine.load_format: dummy)")
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found (other weight formats are not supported)")
    return files


@dataclass(frozen=True)
class _SafetensorsSlice:
    """LazyTensor's fetch for one tensor of one file. Holds the file's safe_open handle (a memory map), so the
    file stays open as long as a LazyTensor of it lives."""

    handle: Any  # safetensors' safe_open
    file: Path
    key: str

    def __call__(self, rows: slice, columns: slice | None) -> torch.Tensor:
        try:
            view = self.handle.get_slice(self.key)
            return view[rows] if columns is None else view[rows, columns]
        except _READ_ERRORS as e:
            raise ModelLoadError(f"{self.file}: tensor {self.key!r} cannot be read: {e}") from None


def load_hf_folder(folder: Path, *, progress: bool = True) -> Checkpoint:
    """Config, tokenizer and every tensor of a Hugging Face folder, as LazyTensor values (only the files'
    headers are read here). Raises ModelLoadError naming the file: here for a file that is not safetensors,
    and when a tensor is read for one whose data cannot be read."""
    info = hf_model_info(folder)
    handles = []
    shards = shard_files(folder)
    for shard in shards:
        try:
            handles.append(safe_open(str(shard), framework="pt"))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{shard}: cannot be read as safetensors (truncated or corrupt?): {e}") from None
    keys = [(h, k, s) for h, s in zip(handles, shards) for k in h.keys()]
    tensors: dict[str, LazyTensor] = {}
    for handle, key, shard in progress_bar(keys, len(keys), f"indexing {folder.name}", progress):
        try:
            shape = tuple(handle.get_slice(key).get_shape())
        except _READ_ERRORS as e:
            raise ModelLoadError(f"{shard}: tensor {key!r} cannot be read: {e}") from None
        tensors[key] = LazyTensor(shape, key, _SafetensorsSlice(handle, shard, key))
    return Checkpoint(config=info.config, weights=tensors, tokenizer=info.tokenizer, source=folder)
