"""GGUF files (llama.cpp), without their tensors: metadata -> ModelConfig and tokenizer. Torch-free (numpy and
the `gguf` package only), so the router can read a model's shape and vocabulary; gguf_index.py opens the file,
gguf_file.py reads the tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.engine.errors import ModelLoadError, UnsupportedModelError
from tandem.engine.loader.checkpoint import ModelInfo
from tandem.engine.loader.gguf_index import GGUFIndex
from tandem.engine.model_config import ModelConfig, RopeConfig
from tandem.engine.tokenizer.gguf_vocab import tokenizer_from_gguf

# GGUF general.architecture -> Hugging Face architecture
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Hugging Face architectures whose Q and K rows llama.cpp's converter permutes for its interleaved RoPE
QK_ROWS_PERMUTED = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


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
        architecture=_ARCHITECTURES[arch],
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


def gguf_model_info(index: GGUFIndex, path: Path) -> ModelInfo:
    """The config and tokenizer of an opened GGUF file (gguf_index.open_gguf). Raises ModelLoadError for missing
    metadata, UnsupportedModelError for an architecture, RoPE variant or tokenizer tandem does not run."""
    config = _config(index.metadata, {t.name for t in index.tensors}, path)
    return ModelInfo(config=config, tokenizer=tokenizer_from_gguf(index.metadata), source=path)
