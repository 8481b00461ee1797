"""GGUF files (llama.cpp): tensors under Hugging Face names, each a LazyTensor that dequantizes just that tensor
from the memory-mapped file when a rank reads it (or, packed, Q4_0/Q4_1 projections kept 4-bit, read at load).
The metadata (config and tokenizer) is read by gguf_metadata.py.

llama.cpp stores Q and K of Llama-architecture models with their rows permuted for its interleaved RoPE;
`_unpermute` undoes that so the weights match the Hugging Face layout (half-split RoPE).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tandem.engine.errors import UnsupportedModelError
from tandem.engine.loader.checkpoint import Checkpoint
from tandem.engine.loader.gguf_index import GGUFIndex, GGUFTensorInfo, open_gguf
from tandem.engine.loader.gguf_metadata import QK_ROWS_PERMUTED, gguf_model_info
from tandem.engine.loader.lazy_tensor import LazyTensor
from tandem.engine.loader.progress import progress_bar
from tandem.engine.models.int4 import Int4Weight

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: rows go from interleaved pairs back to two halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Block layouts of the 4-bit types that can stay packed: header bytes (fp16 d [, fp16 m]) then 16 code bytes.
_Q4_HEADER = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}


def _unpack_q4(data: np.ndarray, qtype: GGMLQuantizationType, rows: int) -> Int4Weight:
    """Raw Q4_0/Q4_1 bytes [rows, row_bytes] -> codes and per-block scale/offset (w = d * code + m)."""
    header = _Q4_HEADER[qtype]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if header == 4 else -8.0 * d
    qs = blocks[..., header:]
    # Low nibbles are a block's first 16 weights, high nibbles its last 16.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))


def _permute_rows(weight: Int4Weight, n_head: int) -> Int4Weight:
    return Int4Weight(*(torch.from_numpy(_unpermute(t.numpy(), n_head)) for t in
                        (weight.codes, weight.scale, weight.offset)))


@dataclass(frozen=True)
class _GGUFTensor:
    """LazyTensor's fetch for one tensor: dequantizes it from the file's memory map (only the rows asked for
    when its rows are stored in order), un-permutes Q/K rows over `heads` (None: not permuted), then slices."""

    file: Path
    index: GGUFIndex
    tensor: GGUFTensorInfo
    shape: tuple[int, ...]
    heads: int | None

    def __call__(self, rows: slice, columns: slice | None) -> torch.Tensor:
        data, shape = self.index.data(self.tensor), self.shape
        # Each stored row (quantized: a run of whole blocks) is one row of the tensor, so a rank's rows can be
        # cut out before dequantizing; permuted Q/K rows are un-permuted over the whole tensor first.
        if self.heads is None and len(shape) == 2:
            data, shape, rows = data[rows], (rows.stop - rows.start, shape[1]), slice(None)
        qtype = GGMLQuantizationType(self.tensor.tensor_type)
        try:
            array = dequantize(data, qtype).astype(np.float32, copy=False).reshape(shape)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise UnsupportedModelError(f"{self.file}: tensor {self.tensor.name!r} of type {qtype.name} cannot be "
                                        f"dequantized by the gguf package ({e})") from None
        if self.heads is not None:
            array = _unpermute(array, self.heads)
        array = array[rows] if columns is None else array[rows, columns]
        if not array.flags.writeable:  # F32 data is the read-only memory map itself (torch.from_numpy warns)
            array = array.copy()
        return torch.from_numpy(array)


def load_gguf(path: Path, *, progress: bool = True, packed: bool = False) -> Checkpoint:
    """Config, tokenizer and every tensor of a GGUF file, as LazyTensor values (dequantized when read).
    packed: keep Q4_0/Q4_1 projection weights as Int4Weight (4-bit codes, read here) instead. Raises
    ModelLoadError / UnsupportedModelError (for a tensor type the gguf package cannot dequantize: when the
    tensor is read)."""
    index = open_gguf(path)
    info = gguf_model_info(index, path)
    config = info.config
    permuted = config.architecture in QK_ROWS_PERMUTED
    tensors: dict[str, LazyTensor | Int4Weight] = {}
    for t in progress_bar(index.tensors, len(index.tensors), f"indexing {path.name}", progress):
        hf = _hf_name(t.name)
        if hf is None:
            continue
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        heads = None
        if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        if packed and qtype in _Q4_HEADER and hf.endswith("_proj.weight"):
            weight = _unpack_q4(index.data(t), qtype, shape[0])
            tensors[hf] = weight if heads is None else _permute_rows(weight, heads)
        else:
            stored = "Q8_0" if qtype == GGMLQuantizationType.Q8_0 else None  # an LM head may stay Q8_0
            tensors[hf] = LazyTensor(shape, t.name, _GGUFTensor(path, index, t, shape, heads), stored)
    return Checkpoint(config=config, weights=tensors, tokenizer=info.tokenizer, source=path)
