"""Tiny random Hugging Face checkpoints written by the tests themselves (config.json + sharded safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2)

CONFIGS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama2_linear_rope_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 1000000.0})),
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24, head_dim=32)),
    # 8 experts, top 2, renormalized (Mixtral always renormalizes).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                            intermediate_size=96)),
    # Qwen-MoE: 8 experts of 48 columns, top 2 without renormalization, a gated shared expert, and layer 1
    # a dense MLP (mlp_only_layers), so every MLP kind the family has is exercised.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])),
    # Qwen3: per-head query/key RMSNorm; the MoE renormalizes its top 2 and has no shared expert.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
}


def write_tiny_model(folder: Path, kind: str, tokenizer) -> Path:
    """Saves a random model of `kind` (a key of CONFIGS) with the given tandem Tokenizer's vocabulary."""
    import transformers

    config_cls, model_cls, extra = CONFIGS[kind]
    config = getattr(transformers, config_cls)(**(TINY | extra | {"vocab_size": tokenizer.vocab_size,
                                                                   "bos_token_id": 1, "eos_token_id": 2}))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # parameters initialised to 0 or 1 would let a missing bias or norm go unnoticed
        for layer in model.model.layers:
            attn = layer.self_attn
            if kind in ("qwen2", "qwen2_moe"):
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
            if kind in ("qwen3", "qwen3_moe"):
                attn.q_norm.weight.normal_(1, 0.3)
                attn.k_norm.weight.normal_(1, 0.3)
    model.save_pretrained(folder, max_shard_size="1MB", safe_serialization=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
    }))
    return folder
