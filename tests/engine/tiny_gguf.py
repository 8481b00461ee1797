"""A tiny random Llama written as a GGUF file the way llama.cpp's converter writes one: Q/K rows permuted,
llama.cpp tensor names, and a different tensor type per projection so every dequantizer is exercised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quantize

from tandem.engine.loader import default_model_path

# llama.cpp name -> tensor type. attn_q/attn_k are 4-bit (packable); attn_v is not, so the fused QKV of the
# packed mode must fall back to dense for this file.
TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1, "ffn_gate": Q.F16,
         "ffn_up": Q.BF16, "ffn_down": Q.Q8_0}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute for Q and K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer: GGUFWriter, name: str, weight: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, weight.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(weight.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_gguf(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = GGUFReader(default_model_path())
    fields = {k: f.contents() for k, f in vocab.fields.items() if k.startswith("tokenizer.")}
    heads, kv_heads, hidden, inter, layers = 4, 2, 64, 160, 2
    config = LlamaConfig(vocab_size=len(fields["tokenizer.ggml.tokens"]), hidden_size=hidden,
                         intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, rms_norm_eps=1e-5, initializer_range=0.2,
                         max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    state = {k: v.numpy() for k, v in LlamaForCausalLM(config).state_dict().items()}

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    adders = {"tokenizer.ggml.tokens": writer.add_token_list, "tokenizer.ggml.token_type": writer.add_token_types,
              "tokenizer.ggml.merges": writer.add_token_merges, "tokenizer.ggml.model": writer.add_tokenizer_model,
              "tokenizer.ggml.pre": writer.add_tokenizer_pre, "tokenizer.chat_template": writer.add_chat_template}
    for key, value in fields.items():
        if key in adders:
            adders[key](value)
        elif key.endswith("_token_id"):
            writer.add_uint32(key, int(value))
        elif isinstance(value, bool):
            writer.add_bool(key, value)

    _add(writer, "token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
    _add(writer, "output.weight", state["lm_head.weight"], Q.F32)
    _add(writer, "output_norm.weight", state["model.norm.weight"], Q.F32)
    for n in range(layers):
        for short, hf in HF_NAMES.items():
            weight = state[f"model.layers.{n}.{hf}.weight"]
            if short == "attn_q":
                weight = _permute(weight, heads)
            elif short == "attn_k":
                weight = _permute(weight, kv_heads)
            _add(writer, f"blk.{n}.{short}.weight", weight, TYPES.get(short, Q.F32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
