"""Small random checkpoints, written deterministically as Hugging Face folders (config.json, model.safetensors,
tokenizer.json from the embedded model), for deployments and tests that need a model shape tandem does not ship
(`tandem make-model tiny-moe DIR`). The same kind and seed always give the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

SYNTHETIC = {
    # Mixtral layout: 8 experts, top 2, every layer sparse; 8 query / 4 KV heads so tp and ep both have room.
    "tiny-moe": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 128,
        "intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "num_local_experts": 8,
        "num_experts_per_tok": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
    },
}
WEIGHT_STD = 0.2  # large enough that logits are far from ties: every layout picks the same greedy token


def write_synthetic_model(kind: str, folder: str | Path, *, seed: int = 0) -> Path:
    """Writes the model `kind` (a key of SYNTHETIC) into folder (created; files overwritten). Raises ValueError
    for an unknown kind."""
    import torch
    from safetensors.torch import save_file

    from tandem.engine.loader.model_info import load_model_info
    from tandem.engine.loader.published_models import write_tokenizer
    from tandem.engine.model_config import model_config_from_hf
    from tandem.engine.models.llama import expected_shapes

    if kind not in SYNTHETIC:
        raise ValueError(f"unknown synthetic model {kind!r}; known: {', '.join(SYNTHETIC)}")
    tokenizer = load_model_info(None).tokenizer
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    bos = tokenizer.backend.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else eos
    config = SYNTHETIC[kind] | {"vocab_size": tokenizer.vocab_size, "bos_token_id": bos, "eos_token_id": eos}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(expected_shapes(model_config_from_hf(config)).items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * WEIGHT_STD
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(folder, tokenizer)
    return folder
