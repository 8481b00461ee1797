"""An opened GGUF file: its metadata and where each tensor lies, parsed once per version of the file.

The `gguf` package's reader builds every metadata field element by element: ~3 s for the embedded model's 49,152
tokens and merges on a fast core, paid by every process that loads the model (each replica, rank and CLI run).
The first open of a file parses it with that reader and keeps what it found, as JSON, under
`$TANDEM_CACHE_DIR/gguf/` (engine/hardware/cache_dir.py), keyed by the file's resolved path, size and modification time
and by the gguf package's version; later opens read that (~20 ms) and map the tensors straight from the file. A
file that changed, a cache that cannot be read or written, or a cache of another format is parsed again, never
trusted. Torch-free (numpy and `gguf` only): the router reads a model's shape through it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from tandem.engine.errors import ModelLoadError
from tandem.engine.hardware.cache_dir import cache_root

FORMAT = 1  # bump when what a cached index holds changes: older files are then parsed again
GGUF_VERSION = importlib.metadata.version("gguf")  # another reader may parse the same file differently
_MAGIC = b"GGUF"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: its GGUF name and type (GGMLQuantizationType's value), its shape in GGUF order
    (fastest dimension first), and its bytes: data_offset from the file's start, laid out as an array of dtype
    and data_shape (for quantized types, rows of whole blocks as uint8)."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    dtype: str
    data_shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFIndex:
    """What open_gguf found: the metadata (field name -> value: str, int, float, bool or a list of them) and the
    tensors in file order."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @cached_property
    def _map(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def data(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only view of the memory-mapped file (nothing is copied)."""
        raw = self._map[tensor.data_offset:tensor.data_offset + tensor.n_bytes]
        return raw.view(np.dtype(tensor.dtype)).reshape(tensor.data_shape)


def metadata_of(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """Every metadata field of an opened reader as plain Python values. Raises ModelLoadError naming a corrupt
    field."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise ModelLoadError(f"{path}: GGUF metadata {key!r} is corrupt ({e})") from None
    return meta


def open_gguf(path: Path) -> GGUFIndex:
    """Opens a GGUF file (memory-mapped; nothing is dequantized), from the cache when this version of it was
    parsed before. Raises ModelLoadError if it is not a GGUF file, or if it is garbled or truncated (a tensor
    ending past the end of the file)."""
    with path.open("rb") as f:
        head = f.read(4)
    if head != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (expected magic 'GGUF', found {head!r}); "
                             "pass a .gguf file or a Hugging Face folder")
    stat = path.stat()
    cached = _cache_file(path.resolve(), stat)
    index = _read_cache(cached, path)
    if index is None:
        index = _parse(path, stat.st_size)
        _write_cache(cached, index)
    return index


def _parse(path: Path, size: int) -> GGUFIndex:
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy/struct raise on a short or garbled file
        raise ModelLoadError(f"{path}: GGUF file is truncated or corrupt ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{path}: GGUF file is truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    tensors = tuple(GGUFTensorInfo(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset),
                                   int(t.n_bytes), t.data.dtype.str, tuple(int(d) for d in t.data.shape))
                    for t in reader.tensors)
    return GGUFIndex(path, metadata_of(reader, path), tensors)


def _cache_file(resolved: Path, stat: os.stat_result) -> Path:
    key = json.dumps([str(resolved), stat.st_size, stat.st_mtime_ns, GGUF_VERSION, FORMAT])
    return cache_root() / "gguf" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_cache(cached: Path, path: Path) -> GGUFIndex | None:
    """The index kept in `cached`, or None (absent, unreadable or of another format: parse the file again)."""
    try:
        saved = json.loads(cached.read_text())
        if saved.get("format") != FORMAT:
            return None
        tensors = tuple(GGUFTensorInfo(t["name"], t["tensor_type"], tuple(t["shape"]), t["data_offset"],
                                       t["n_bytes"], t["dtype"], tuple(t["data_shape"])) for t in saved["tensors"])
        return GGUFIndex(path, saved["metadata"], tensors)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        _log.warning("ignoring the GGUF index cache %s (%s: %s); parsing %s again", cached, type(e).__name__, e,
                     path)
        return None


def _write_cache(cached: Path, index: GGUFIndex) -> None:
    """Keeps the index for later opens: written whole to a temporary file, then renamed (processes loading the
    same file at once each write a complete copy). A cache folder that cannot be written only costs speed."""
    saved = {"format": FORMAT, "metadata": index.metadata,
             "tensors": [{"name": t.name, "tensor_type": t.tensor_type, "shape": t.shape, "data_offset": t.data_offset,
                          "n_bytes": t.n_bytes, "dtype": t.dtype, "data_shape": t.data_shape}
                         for t in index.tensors]}
    try:
        text = json.dumps(saved)
    except (TypeError, ValueError) as e:  # a metadata value JSON cannot hold: parse this file each time
        _log.info("not caching the GGUF index of %s (%s)", index.path, e)
        return
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cached.parent, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, cached)
    except OSError as e:
        _log.warning("could not keep the GGUF index of %s in %s (%s); the next load parses it again", index.path,
                     cached, e)
