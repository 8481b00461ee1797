"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): GQA/MQA, RMSNorm, SwiGLU, RoPE, optional biases.

Weights arrive as a Hugging Face-named state dict (both loaders produce one) and are repacked for fast batch-1
decode: Q/K/V fused into one matrix and gate/up into another, all stored transposed ([in, out]) so a decode step
streams each matrix once in memory order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.config import ModelConfig
from tandem.engine.errors import ModelLoadError
from tandem.engine.kv_cache import PagedKVCache
from tandem.engine.models.rope import RotaryEmbedding


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by Hugging Face name, with its [out, in] shape."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.q_size, h),
            p + "self_attn.k_proj.weight": (config.kv_size, h),
            p + "self_attn.v_proj.weight": (config.kv_size, h),
            p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (config.q_size,), p + "self_attn.k_proj.bias": (config.kv_size,),
                       p + "self_attn.v_proj.bias": (config.kv_size,)}
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)}
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raises ModelLoadError naming the first missing tensor or the first whose shape disagrees with the config."""
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing (the config needs it)")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)} but the config implies {shape} "
                f"(hidden_size={config.hidden_size}, heads={config.num_heads}/{config.num_kv_heads}, "
                f"head_dim={config.head_dim}, intermediate_size={config.intermediate_size}, "
                f"vocab_size={config.vocab_size})"
            )


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # [hidden, q + 2 kv]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [q, hidden]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [intermediate, hidden]
    down_bias: torch.Tensor | None
    window: int | None


def _linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.addmm(bias, x, w_t) if bias is not None else x @ w_t


class LlamaModel:
    """A decoder whose attention reads and writes K/V through block tables into a PagedKVCache."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None):
        """Consumes `weights` (entries are popped to keep peak memory low). Raises ModelLoadError on bad shapes."""
        check_weights(config, weights, "weights")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = config.head_dim**-0.5
        self.attention = TorchAttentionBackend()

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=self.device, dtype=dtype)

        def take_opt(name: str) -> torch.Tensor | None:
            return take(name) if name in weights else None

        def fuse_t(*names: str) -> torch.Tensor:
            return torch.cat([weights.pop(n).to(dtype) for n in names], dim=0).t().contiguous().to(self.device)

        def fuse_bias(*names: str) -> torch.Tensor | None:
            return torch.cat([take(n) for n in names]) if names[0] in weights else None

        self.layers: list[_Layer] = []
        for n in range(config.num_layers):
            p = f"model.layers.{n}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(_Layer(
                input_norm=take(p + "input_layernorm.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                qkv_bias=fuse_bias(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                qkv=fuse_t(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                o_bias=take_opt(a + "o_proj.bias"),
                o=fuse_t(a + "o_proj.weight"),
                gate_up_bias=fuse_bias(m + "gate_proj.bias", m + "up_proj.bias"),
                gate_up=fuse_t(m + "gate_proj.weight", m + "up_proj.weight"),
                down_bias=take_opt(m + "down_proj.bias"),
                down=fuse_t(m + "down_proj.weight"),
                window=config.sliding_windows[n],
            ))
        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        # Tied heads reuse the embedding ([vocab, hidden]); untied ones are stored transposed like every matrix.
        self.lm_head_t = None if config.tie_word_embeddings else fuse_t("lm_head.weight")
        positions = max_positions or config.max_position_embeddings
        self.rope = RotaryEmbedding(config.rope, config.head_dim, positions, dtype, self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return weight * normed.to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids, positions: [T] int64 (the batch's new tokens, flattened). Returns hidden states [T, hidden].

        Mutates kv_cache: each new token's K/V is written at meta.slot_mapping in every layer.
        """
        cfg = self.config
        if int(positions.max()) >= self.rope.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the model's {self.rope.max_positions}")
        t = input_ids.shape[0]
        h = self.embed[input_ids]
        for index, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm)
            qkv = _linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(t, cfg.num_heads, cfg.head_dim)
            k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            q, k = self.rope(positions, q, k)
            k_cache, v_cache = kv_cache.layer(index)
            attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale, layer.window)
            h = h + _linear(attn, layer.o, layer.o_bias)
            x = self._norm(h, layer.post_norm)
            gate, up = _linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            h = h + _linear(F.silu(gate) * up, layer.down, layer.down_bias)
        return self._norm(h, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (already normed) -> float32 logits [N, vocab]."""
        if self.lm_head_t is None:
            return F.linear(hidden, self.embed).float()
        return (hidden @ self.lm_head_t).float()


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], **kwargs) -> LlamaModel:
    """Instantiates the model class for config.architecture (every supported one is Llama-shaped today)."""
    return LlamaModel(config, weights, **kwargs)
