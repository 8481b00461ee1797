"""Hugging Face folders shaped like the large models of deploy/manifests/gpu-*.yaml as they are deployed (load_format
auto), so that `tandem validate` (and the tests of deploy/ray/ and deploy/helm/) can check those manifests on a CPU
machine: the published config.json of each model (what `tandem make-model --like` writes), a tokenizer, and a
safetensors index naming empty shard files.

    folder = write_hf_shaped_folder(tmp_path / "Meta-Llama-3-70B-Instruct", LLAMA3_70B, embedded_shape.tokenizer)
    path.write_text(manifest_with_model((MANIFESTS / "gpu-llama3-70b.yaml").read_text(), folder))

Validation reads config.json and the tokenizer, and checks that every shard the index names exists (the ranks
will read them); it never opens a shard, so empty files do. The tokenizer is whichever tandem Tokenizer the
caller passes (the embedded model's): validation never compares its vocabulary with the config's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tandem.engine.loader.published_models import PUBLISHED, write_tokenizer

# The published configs (engine/loader/published_models.py, where each is cited).
LLAMA3_8B: dict = PUBLISHED["meta-llama/Meta-Llama-3-8B-Instruct"]
LLAMA3_70B: dict = PUBLISHED["meta-llama/Meta-Llama-3-70B-Instruct"]
MIXTRAL_8X22B: dict = PUBLISHED["mistralai/Mixtral-8x22B-Instruct-v0.1"]

NUM_SHARDS = 4  # the real checkpoints have more (30 and 59): validation only checks the named files exist
BYTES_PER_PARAM = 2  # bfloat16, as both checkpoints are published


def layer_tensors(config: dict) -> list[str]:
    """The weight names of one decoder layer, as Hugging Face checkpoints of this model_type name them."""
    attention = [f"self_attn.{p}_proj" for p in "qkvo"]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config["model_type"] == "mixtral":
        experts = [f"block_sparse_moe.experts.{e}.{w}" for e in range(config["num_local_experts"])
                   for w in ("w1", "w2", "w3")]
        return attention + ["block_sparse_moe.gate"] + experts + norms
    return attention + [f"mlp.{p}_proj" for p in ("gate", "up", "down")] + norms


def num_params(config: dict) -> int:
    """The parameter count of a Llama or Mixtral config (no biases): what its checkpoint's weights add up to."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    attention = 2 * hidden * hidden + 2 * hidden * kv  # q and o; k and v
    mlp = 3 * hidden * config["intermediate_size"]  # gate, up, down (w1, w3, w2)
    if config["model_type"] == "mixtral":
        mlp = config["num_local_experts"] * mlp + hidden * config["num_local_experts"]  # + the router
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * (attention + mlp + 2 * hidden) + hidden + embeddings


def write_hf_shaped_folder(folder: Path, config: dict, tokenizer) -> Path:
    """Writes a weight-free Hugging Face folder shaped by config (a config.json as a dict, e.g. LLAMA3_70B):
    config.json, tokenizer.json and tokenizer_config.json from the given tandem Tokenizer, and
    model.safetensors.index.json spreading the model's tensors over NUM_SHARDS empty shard files (its
    metadata.total_size is what the real bfloat16 weights weigh). Returns folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(folder, tokenizer)
    layers = config["num_hidden_layers"]
    shards = [f"model-{i + 1:05d}-of-{NUM_SHARDS:05d}.safetensors" for i in range(NUM_SHARDS)]
    weight_map = {"model.embed_tokens.weight": shards[0]}
    for layer in range(layers):
        for name in layer_tensors(config):
            weight_map[f"model.layers.{layer}.{name}.weight"] = shards[layer * NUM_SHARDS // layers]
    weight_map["model.norm.weight"] = shards[-1]
    if not config.get("tie_word_embeddings"):
        weight_map["lm_head.weight"] = shards[-1]
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": num_params(config) * BYTES_PER_PARAM}, "weight_map": weight_map}, indent=2))
    for name in shards:
        (folder / name).touch()
    return folder


def manifest_with_model(text: str, model: Path, *, dummy: bool = False) -> str:
    """A manifest's text with its one top-level `model:` line naming model instead; with dummy, each pool's
    `engine: {...}` also says load_format: dummy (for a `tandem make-model --like` folder, which has no weights).
    Raises ValueError if the text has no such line or several, or (dummy) no flow-style engine section."""
    replaced, count = re.subn(r"(?m)^model:.*$", f"model: {model}", text)
    if count != 1:
        raise ValueError(f"expected exactly one top-level `model:` line, found {count}")
    if dummy:
        replaced, count = re.subn(r"(?m)^(\s+engine: \{)", r"\1load_format: dummy, ", replaced)
        if count == 0:
            raise ValueError("expected pools with a flow-style `engine: {...}` section")
    return replaced


def make_model_like(name: str, folder: Path) -> Path:
    """`tandem make-model --like name folder`: the published shape, no weights. Returns folder."""
    from tandem.cluster.cli import main

    if main(["make-model", "--like", name, str(folder)]) != 0:
        raise RuntimeError(f"tandem make-model --like {name} {folder} failed")
    return folder
