"""Model configuration: one frozen dataclass, parsed once from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tandem.engine.errors import ModelLoadError, UnsupportedModelError

# Hugging Face architecture name -> model_type. All of them run on `engine/models/llama.py` (the MoE ones with
# `engine/models/moe.py` in place of the MLP).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `rope_type` is one of ROPE_TYPES; the other fields matter only for it."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs. sparse_layers[i] is True where layer i routes to experts (else a dense MLP of
    ModelConfig.intermediate_size). Routing: softmax over num_experts, top_k, then renormalized to sum 1 when
    renormalize (Mixtral always; Qwen-MoE when norm_topk_prob). A shared expert (Qwen-MoE) of
    shared_intermediate_size columns runs on every token, scaled by sigmoid(shared gate)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    shared_intermediate_size: int = 0
    weights_in_float: bool = False  # Mixtral keeps routing weights in float32; Qwen-MoE casts them to the model's


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. Sizes are in elements, lengths in tokens."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    # Per layer: None for full attention, else the window in tokens (a key is visible when q_pos - k_pos < window).
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling {self.rope.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.moe is not None:
            m = self.moe
            if not 0 < m.top_k <= m.num_experts or m.intermediate_size <= 0:
                raise ModelLoadError(f"model config: {m.num_experts} experts with top_k={m.top_k} and expert "
                                     f"intermediate size {m.intermediate_size} is not a valid MoE")
            if len(m.sparse_layers) != self.num_layers:
                raise ModelLoadError(f"model config: {len(m.sparse_layers)} MoE layer flags for {self.num_layers} "
                                     "layers")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        elif len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError(f"model config: {len(self.sliding_windows)} sliding-window entries (layer_types) "
                                 f"for {self.num_layers} layers")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe else 0


def read_json_file(path: Path) -> dict[str, Any]:
    """A model folder's JSON file ({} if absent). Raises ModelLoadError naming the file if it does not parse."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from None


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    """Reads `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older checkpoints)."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return RopeConfig(
        theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _sliding_windows(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if model_type in _QWEN and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if model_type == "qwen2":  # older Qwen2 configs: the layers from max_window_layers on use the window
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _moe_from_hf(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> MoEConfig | None:
    if model_type == "mixtral":
        return MoEConfig(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                         intermediate_size=int(cfg["intermediate_size"]), renormalize=True,
                         sparse_layers=(True,) * num_layers, weights_in_float=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        # Hub checkpoints say num_experts; configs saved by transformers >= 5 may say num_local_experts.
        experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
        step = int(cfg.get("decoder_sparse_step", 1)) or 1
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        return MoEConfig(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                         intermediate_size=int(cfg["moe_intermediate_size"]),
                         renormalize=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse,
                         shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))
    return None


def model_config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a parsed Hugging Face `config.json`. Raises ModelLoadError on missing keys."""
    architectures = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        if not architectures and model_type in by_type:
            arch = by_type[model_type]
        else:
            named = ", ".join(architectures) or f"model_type={model_type!r}"
            raise UnsupportedModelError(
                f"architecture {named} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
    model_type = SUPPORTED_ARCHITECTURES[arch]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and cfg.get("qkv_bias", True))
                      or bool(cfg.get("attention_bias", False))),
            o_bias=model_type not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(cfg, model_type, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            moe=_moe_from_hf(cfg, model_type, num_layers),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json is missing the required key {e.args[0]!r}") from None
