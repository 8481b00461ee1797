"""Reads a LoRA adapter in PEFT's format (a folder with adapter_config.json and adapter_model.safetensors, as
`peft`'s save_pretrained writes it) for a model of this shape, checked before anything is served with it.

What is served: LoRA (not DoRA) on any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj of the
attention and of the dense MLPs (not an MoE layer's experts), one rank for every module (no rank_pattern), no
trained biases and no modules_to_save, weights stored [out, in] (fan_in_fan_out off). The scaling is
lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from tandem.engine.errors import TandemError
from tandem.engine.model_config import ModelConfig
from tandem.engine.models.lora import TARGETS, LoRAWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(TandemError, ValueError):
    """An adapter that cannot be served with this model and limits: the message says why."""


def module_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """[out, in] of one projection of a dense layer."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}[target]


def _settings(path: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json; raises LoRAAdapterError for what is not served."""
    try:
        settings = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"{path} is not a LoRA adapter: {CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{path / CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(settings, dict) or settings.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path}: only LoRA adapters are served (peft_type {settings.get('peft_type')!r})")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{path}: r must be a positive integer and lora_alpha a number")
    if rank > max_rank:
        raise LoRAAdapterError(f"{path}: rank {rank} is over this replica's lora.max_rank ({max_rank})")
    unsupported = [name for name in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save")
                   if settings.get(name)] + (["bias"] if settings.get("bias", "none") != "none" else [])
    if bad := unsupported:
        raise LoRAAdapterError(f"{path}: {', '.join(bad)} is not served (plain LoRA only)")
    return rank, alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def check_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> tuple[int, float]:
    """Checks the adapter at `path` against the model's shape from its config and its tensors' headers (no weight
    is read): every tensor a LoRA A [r, in] or B [out, r] of a served module of an existing dense layer, in
    pairs. Returns (rank, scaling). Raises LoRAAdapterError naming the first problem."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    rank, scaling = _settings(path, max_rank)
    try:
        with safe_open(path / WEIGHTS_FILE, "pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except FileNotFoundError:
        raise LoRAAdapterError(f"{path}: {WEIGHTS_FILE} is missing") from None
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(f"{path / WEIGHTS_FILE} cannot be read: {e}") from None
    halves: dict[tuple[int, str], set[str]] = {}
    for key, shape in shapes.items():
        layer, target, half = _module_of(path, key, config)
        out, inp = module_shape(config, target)
        expected = (rank, inp) if half == "A" else (out, rank)
        if shape != expected:
            raise LoRAAdapterError(f"{path}: {key!r} has shape {shape}, expected {expected} (r={rank})")
        halves.setdefault((layer, target), set()).add(half)
    if not halves:
        raise LoRAAdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    if unpaired := [f"layer {n} {t}" for (n, t), pair in halves.items() if len(pair) != 2]:
        raise LoRAAdapterError(f"{path}: lora_A and lora_B must come in pairs; alone: {', '.join(unpaired[:3])}")
    return rank, scaling


def _module_of(path: Path, key: str, config: ModelConfig) -> tuple[int, str, str]:
    """(layer, target, "A" or "B") of a PEFT tensor name; raises LoRAAdapterError for one that is not served."""
    found = _KEY.search(key)
    if found is None or found[2] not in TARGETS:
        raise LoRAAdapterError(f"{path}: tensor {key!r} is not a LoRA weight of {', '.join(TARGETS)}")
    layer, target = int(found[1]), found[2]
    if layer >= config.num_layers:
        raise LoRAAdapterError(f"{path}: {key!r} names layer {layer}; the model has {config.num_layers}")
    if config.moe is not None and config.moe.sparse_layers[layer] and target in ("gate_proj", "up_proj", "down_proj"):
        raise LoRAAdapterError(f"{path}: {key!r}: layer {layer}'s MLP is a mixture of experts (not served)")
    return layer, target, found[3]


def read_adapter(path: str | Path, name: str, config: ModelConfig, max_rank: int) -> LoRAWeights:
    """The adapter at `path` (checked as check_adapter does), its weights read as float32 on the CPU. Raises
    LoRAAdapterError naming the first problem."""
    from safetensors.torch import load_file

    path = Path(path)
    rank, scaling = check_adapter(path, config, max_rank)
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(path / WEIGHTS_FILE).items():
        layer, target, half = _module_of(path, key, config)
        modules.setdefault((layer, target), {})[half] = tensor.float()
    return LoRAWeights(name, rank, scaling, {key: (pair["A"], pair["B"]) for key, pair in modules.items()})


def write_random_adapter(folder: str | Path, config: ModelConfig, rank: int, *, targets: tuple[str, ...] = TARGETS,
                         alpha: float | None = None, seed: int = 0, scale: float = 0.02) -> Path:
    """A LoRA adapter in PEFT's format with random A and B (normal, times `scale`) on `targets` of every dense layer:
    what benchmarks and tests serve when the values do not matter. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        sparse = config.moe is not None and config.moe.sparse_layers[layer]
        for target in targets:
            if sparse and target in ("gate_proj", "up_proj", "down_proj"):
                continue
            out, inp = module_shape(config, target)
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * scale
    save_file(tensors, folder / WEIGHTS_FILE)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or rank, "target_modules": list(targets),
                "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}
    (folder / CONFIG_FILE).write_text(json.dumps(settings, indent=2))
    return folder
