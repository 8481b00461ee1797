"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized to float32 under Hugging Face names.

llama.cpp stores Q and K of Llama-architecture models with their rows permuted for its interleaved RoPE;
`_unpermute` undoes that so the weights match the Hugging Face layout (half-split RoPE).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tandem.engine.config import ModelConfig, RopeConfig
from tandem.engine.errors import ModelLoadError, UnsupportedModelError
from tandem.engine.loader.checkpoint import Checkpoint
from tandem.engine.loader.progress import progress_bar
from tandem.engine.models.int4 import Int4Weight
from tandem.engine.tokenizer.gguf_vocab import tokenizer_from_gguf

# GGUF general.architecture -> (HF architecture, Q/K rows permuted by llama.cpp's converter)
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "mistral": ("MistralForCausalLM", True),
                  "qwen2": ("Qwen2ForCausalLM", False)}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_MAGIC = b"GGUF"


def _open(path: Path) -> GGUFReader:
    with path.open("rb") as f:
        head = f.read(4)
    if head != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (expected magic 'GGUF', found {head!r}); "
                             "pass a .gguf file or a Hugging Face folder")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy/struct raise on a short or garbled file
        raise ModelLoadError(f"{path}: GGUF file is truncated or corrupt ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{path}: GGUF file is truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


def _metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise ModelLoadError(f"{path}: GGUF metadata {key!r} is corrupt ({e})") from None
    return meta


def _config(meta: dict[str, Any], tensor_names: set[str], path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(sorted(_ARCHITECTURES))}")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(f"{path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) "
                                    "are not supported from GGUF; load the Hugging Face folder instead")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata {full!r} is missing")
        return meta[full]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    rope = RopeConfig(
        theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_type="default" if scaling in ("none", None) else scaling,
        factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
    )
    layers = int(need("block_count"))
    window = meta.get(f"{arch}.attention.sliding_window")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_ARCHITECTURES[arch][0],
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        rope=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        sliding_windows=(int(window),) * layers if window else (),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


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


def _permute_rows(weight: torch.Tensor | Int4Weight, n_head: int) -> torch.Tensor | Int4Weight:
    if isinstance(weight, Int4Weight):
        return Int4Weight(*(torch.from_numpy(_unpermute(t.numpy(), n_head)) for t in
                            (weight.codes, weight.scale, weight.offset)))
    return torch.from_numpy(_unpermute(weight.numpy(), n_head))


def load_gguf(path: Path, *, progress: bool = True, packed: bool = False, weights: bool = True) -> Checkpoint:
    """packed: keep Q4_0/Q4_1 projection weights as Int4Weight (4-bit codes) instead of dequantizing them.
    weights: False reads only the metadata (config and tokenizer)."""
    reader = _open(path)
    meta = _metadata(reader, path)
    names = {t.name for t in reader.tensors}
    config = _config(meta, names, path)
    tokenizer = tokenizer_from_gguf(meta)
    permuted = _ARCHITECTURES[meta["general.architecture"]][1]
    tensors: dict[str, torch.Tensor] = {}
    for t in progress_bar(reader.tensors if weights else [], len(reader.tensors), f"loading {path.name}",
                          progress and weights):
        hf = _hf_name(t.name)
        if hf is None:
            continue
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        if packed and qtype in _Q4_HEADER and hf.endswith("_proj.weight"):
            weight: torch.Tensor | Int4Weight = _unpack_q4(t.data, qtype, shape[0])
        else:
            try:
                array = dequantize(t.data, qtype).astype(np.float32, copy=False).reshape(shape)
            except (NotImplementedError, ValueError, KeyError) as e:
                raise UnsupportedModelError(f"{path}: tensor {t.name!r} of type {qtype.name} cannot be "
                                            f"dequantized by the gguf package ({e})") from None
            if not array.flags.writeable:  # F32 tensors come straight from the read-only memory map
                array = array.copy()
            weight = torch.from_numpy(np.ascontiguousarray(array))
        if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _permute_rows(weight, config.num_heads)
        elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _permute_rows(weight, config.num_kv_heads)
        tensors[hf] = weight
    return Checkpoint(config=config, weights=tensors, tokenizer=tokenizer, source=path)
