"""A checkpoint tensor that is read only when the model asks for it, and only the part it asks for.

The loaders return LazyTensor values instead of tensors, so a rank of a tensor- or pipeline-parallel replica
reads its own layers, heads, MLP columns and experts straight from the file into its device and dtype, and
never holds the whole model in host memory. A LazyTensor keeps its file open (a memory map) as long as it lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# (rows, columns) -> that part of the tensor, in the file's dtype on the CPU; columns is None for a 1-D tensor.
# The result may share memory with the file's mapping (read() copies it). Raises ModelLoadError naming the
# file and the tensor when the data cannot be read.
Fetch = Callable[[slice, slice | None], torch.Tensor]


def check_range(part: range | None, size: int, what: str, name: str) -> slice:
    """The slice a range of rows or columns names (None: all of size). Raises ValueError for a range that is not
    a contiguous run within 0..size."""
    if part is None:
        return slice(0, size)
    if part.step != 1 or not 0 <= part.start <= part.stop <= size:
        raise ValueError(f"{name}: {what} {part} are not a contiguous run within 0..{size}")
    return slice(part.start, part.stop)


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """shape: the whole tensor's shape ([out, in] for a projection), known without reading data. name: the
    tensor's name in `fetch`'s file, for messages. stored: the file's type of it where a kernel may read it as
    stored ("Q8_0": a GGUF tensor of that type), else None."""

    shape: tuple[int, ...]
    name: str
    fetch: Fetch
    stored: str | None = None

    def read(self, rows: range | None = None, columns: range | None = None, *, dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor:
        """The rows (dim 0) and columns (dim 1, 2-D tensors only) asked for, None meaning all, read from the
        file and converted once to `dtype` on `device`: a new tensor that shares no memory with the file.
        Raises ValueError for a range outside the shape, ModelLoadError when the file cannot be read."""
        row_slice = check_range(rows, self.shape[0], "rows", self.name)
        if columns is not None and len(self.shape) != 2:
            raise ValueError(f"{self.name}: columns asked of a {len(self.shape)}-D tensor")
        column_slice = None if len(self.shape) == 1 else check_range(columns, self.shape[1], "columns", self.name)
        part = self.fetch(row_slice, column_slice)
        return part.to(device=device, dtype=dtype, copy=True)

    def materialize(self) -> torch.Tensor:
        """The whole tensor as float32 on the CPU (what the loaders returned before they became lazy)."""
        return self.read(dtype=torch.float32, device="cpu")
