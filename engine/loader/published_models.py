"""The shapes of published models, so that tandem can be deployed, validated and measured at the sizes users run
without their weights: `tandem make-model --like NAME OUT` writes NAME's config.json, as published on the
Hugging Face Hub, beside the embedded model's tokenizer; with `load_format: dummy` (engine/loader/dummy_weights.py)
the engine makes random weights of those shapes on each rank's device.

Each config below is copied from the model's config.json at the address given (the fields tandem and transformers
read; the training-only ones, such as initializer_range, left out). The vocabulary stays the published one, so
the embedding and LM head weigh what they weigh in the real model; the tokenizer is the embedded model's 49,152
tokens (ids beyond it decode to nothing), with its chat template, so prompts and the chat API work unchanged. A
vocabulary smaller than that (Mixtral's 32,000) gets the tokenizer cut to its first ids (fit_tokenizer_json), so
no prompt holds an id the model does not have.
Torch-free: the router and `tandem validate` read these folders like any other.
"""

from __future__ import annotations

import json
from pathlib import Path

_LLAMA3_ROPE_8K = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

PUBLISHED: dict[str, dict] = {
    # https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct/blob/main/config.json
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct/blob/main/config.json
    "meta-llama/Meta-Llama-3-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B-Instruct/blob/main/config.json: the 8B's but for its size
    "meta-llama/Meta-Llama-3-70B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 8192,
        "intermediate_size": 28672, "max_position_embeddings": 8192, "num_attention_heads": 64,
        "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    # https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json
    "meta-llama/Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA3_ROPE_8K,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    # https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json
    "meta-llama/Llama-3.1-70B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 8192,
        "intermediate_size": 28672, "max_position_embeddings": 131072, "num_attention_heads": 64,
        "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA3_ROPE_8K,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    # https://huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/main/config.json
    "mistralai/Mixtral-8x7B-Instruct-v0.1": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
    },
    # https://huggingface.co/mistralai/Mixtral-8x22B-Instruct-v0.1/blob/main/config.json
    "mistralai/Mixtral-8x22B-Instruct-v0.1": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 6144, "intermediate_size": 16384, "max_position_embeddings": 65536,
        "num_attention_heads": 48, "num_experts_per_tok": 2, "num_hidden_layers": 56, "num_key_value_heads": 8,
        "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32768,
    },
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936,
    },
}

MADE_BY = "tandem_make_model.json"  # what a folder written here says about itself (which model, no weights)


def find_published(name: str) -> str:
    """The Hub id in PUBLISHED that `name` means: the id itself or its part after the slash, any case, or the
    start of exactly one of them ("Llama-3.1-8B" -> "meta-llama/Llama-3.1-8B-Instruct"). Raises ValueError
    naming the known ones otherwise."""
    wanted = name.lower()
    exact = [hub for hub in PUBLISHED if wanted in (hub.lower(), hub.split("/")[1].lower())]
    matches = exact or [hub for hub in PUBLISHED
                        if hub.lower().startswith(wanted) or hub.split("/")[1].lower().startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(hub.split("/")[1] for hub in PUBLISHED)
    if matches:
        raise ValueError(f"{name!r} could be any of {', '.join(matches)}; say which")
    raise ValueError(f"no published model {name!r} is known; known: {known}")


def fit_tokenizer_json(text: str, vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json (text) cut to its ids below vocab_size: the vocabulary, the merges whose
    parts and result all stay, and the added tokens that stay. Every text still encodes (the 256 byte tokens
    come first), into fewer merged tokens. Returns text unchanged when every id is already below vocab_size.
    Raises ValueError for a tokenizer of another kind or a cut that would drop a byte token."""
    data = json.loads(text)
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only a BPE tokenizer can be cut to {vocab_size} ids, not {model.get('type')}")
    vocab = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    if len(vocab) == len(model["vocab"]) and all(t["id"] < vocab_size for t in data.get("added_tokens", [])):
        return text
    if len(vocab) < 256 + 1:
        raise ValueError(f"{vocab_size} ids cannot hold the byte tokens")
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    kept = [m for m, (a, b) in zip(model["merges"], pairs) if a in vocab and b in vocab and a + b in vocab]
    data["model"] = model | {"vocab": vocab, "merges": kept}
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["id"] < vocab_size]
    return json.dumps(data, ensure_ascii=False)


def write_tokenizer(folder: Path, tokenizer, vocab_size: int | None = None) -> None:
    """Writes a tandem Tokenizer as a Hugging Face folder holds it: tokenizer.json (cut to vocab_size ids when
    given, fit_tokenizer_json), and tokenizer_config.json with its chat template and special tokens."""
    text = tokenizer.backend.to_str()
    (folder / "tokenizer.json").write_text(text if vocab_size is None else fit_tokenizer_json(text, vocab_size))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tokenizer.chat_template, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}))


def write_published_shape(name: str, folder: str | Path, tokenizer) -> Path:
    """Writes the folder of the published model `name` (find_published): its config.json, the given tandem
    Tokenizer (tokenizer.json, tokenizer_config.json with the chat template) and MADE_BY; no weights, so it loads
    with load_format dummy. Returns the folder (created; files overwritten). Raises ValueError for an unknown
    name."""
    hub = find_published(name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(PUBLISHED[hub], indent=2) + "\n")
    write_tokenizer(folder, tokenizer, PUBLISHED[hub]["vocab_size"])
    (folder / MADE_BY).write_text(json.dumps(
        {"like": hub, "config": f"https://huggingface.co/{hub}/blob/main/config.json",
         "weights": "none: load it with load_format dummy (random weights of these shapes)"}, indent=2) + "\n")
    return folder
