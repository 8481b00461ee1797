"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): GQA/MQA, RMSNorm, SwiGLU, RoPE, optional biases.

Weights arrive as a Hugging Face-named state dict (both loaders produce one) and are repacked for fast batch-1
decode: Q/K/V fused into one projection and gate/up into another, each in the layout `Linear` picks for the
device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.config import ModelConfig
from tandem.engine.errors import ModelLoadError
from tandem.engine.kv_cache import PagedKVCache
from tandem.engine.models.int4 import Int4Linear, Int4Weight
from tandem.engine.models.linear import Linear
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


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor | Int4Weight], source: str) -> None:
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
    qkv: Linear | Int4Linear  # [hidden] -> [q + 2 kv]
    o: Linear | Int4Linear
    gate_up: Linear | Int4Linear  # [hidden] -> [2 * intermediate]
    down: Linear | Int4Linear
    window: int | None


class LlamaModel:
    """A decoder whose attention reads and writes K/V through block tables into a PagedKVCache."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | Int4Weight], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None, source: str = "weights"):
        """Consumes `weights` (entries are popped to keep peak memory low). Int4Weight entries stay packed when
        every part of a fused projection is packed. Raises ModelLoadError on bad shapes, ValueError if packed
        weights are combined with a dtype other than bfloat16."""
        check_weights(config, weights, source)  # source names the checkpoint in errors
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = config.head_dim**-0.5
        self.attention = TorchAttentionBackend()

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=self.device, dtype=dtype)

        packed = [n for n, w in weights.items() if isinstance(w, Int4Weight)]
        if packed and dtype != torch.bfloat16:
            raise ValueError(f"packed 4-bit weights compute in bfloat16, but dtype {dtype} was asked for")

        def linear(*names: str) -> Linear | Int4Linear:
            """One projection from the concatenated [out, in] weights (and biases, if present) of `names`."""
            parts = [weights.pop(f"{n}.weight") for n in names]
            biases = [weights.pop(f"{n}.bias") for n in names if f"{n}.bias" in weights]
            bias = torch.cat(biases) if biases else None
            if all(isinstance(p, Int4Weight) for p in parts):
                return Int4Linear(Int4Weight.cat(parts), bias, device=self.device)
            dense = [p.dequantize() if isinstance(p, Int4Weight) else p for p in parts]
            return Linear(torch.cat(dense), bias, dtype=dtype, device=self.device)

        self.layers: list[_Layer] = []
        for n in range(config.num_layers):
            p = f"model.layers.{n}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(_Layer(
                input_norm=take(p + "input_layernorm.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                qkv=linear(a + "q_proj", a + "k_proj", a + "v_proj"),
                o=linear(a + "o_proj"),
                gate_up=linear(m + "gate_proj", m + "up_proj"),
                down=linear(m + "down_proj"),
                window=config.sliding_windows[n],
            ))
        self.norm = take("model.norm.weight")
        if config.tie_word_embeddings:
            # The head gets its own copy in the product layout; the embedding stays [vocab, hidden] for lookups.
            self.embed = take("model.embed_tokens.weight")
            self.lm_head = Linear(self.embed, None, dtype=dtype, device=self.device)
        else:
            self.embed = take("model.embed_tokens.weight")
            self.lm_head = linear("lm_head")
        positions = max_positions or config.max_position_embeddings
        self.rope = RotaryEmbedding(config.rope, config.head_dim, positions, dtype, self.device)

    def weight_bytes_per_token(self) -> int:
        """Bytes a batch-1 decode step reads: every projection, every norm and the LM head (the embedding
        lookup reads one row, which is negligible)."""
        total = self.lm_head.nbytes + self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            total += sum(lin.nbytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * layer.input_norm.element_size()
        return total

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # Lower precision: normalize in float32, round, then scale (the reference's order of operations).
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

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
        heads = cfg.num_heads + cfg.num_kv_heads
        cos, sin = self.rope.lookup(positions)
        h = self.embed[input_ids]
        for index, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm)
            qkv = layer.qkv(x)
            # Q and K sit side by side in the fused output: rotate them in one pass.
            qk = self.rope.rotate(qkv[:, : cfg.q_size + cfg.kv_size].view(t, heads, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, cfg.q_size + cfg.kv_size :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
            attn = self.attention.forward(q, k, v, kv_cache.layer(index), meta, self.scale, layer.window)
            h = h + layer.o(attn)
            x = self._norm(h, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return self._norm(h, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (already normed) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], **kwargs) -> LlamaModel:
    """Instantiates the model class for config.architecture (every supported one is Llama-shaped today)."""
    return LlamaModel(config, weights, **kwargs)
