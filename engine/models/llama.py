"""The Llama family (Llama 2/3, Mistral, Qwen2/3, SmolLM2) and its MoE variants (Mixtral, Qwen2/3-MoE): GQA/MQA,
RMSNorm, SwiGLU or routed experts, RoPE, optional biases and per-head query/key norms.

Weights arrive as a Hugging Face-named dict (both loaders produce one, of lazily read tensors: each rank reads
only its own rows and columns, straight into its device and dtype) and are repacked for fast batch-1 decode:
Q/K/V fused into one projection and gate/up into another, each in the layout `Linear` picks for the device and
dtype.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn.functional as F

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.attention.cpu_decode import PagedStep
from tandem.engine.attention.torch_ref import fixed_decode_plan, tuned_decode_plan
from tandem.engine.hardware.cpu_kernels import kernel_path
from tandem.engine.errors import ModelLoadError
from tandem.engine.hardware.cpu_features import CpuFeatures, cpu_features
from tandem.engine.hardware.kernel_tuning import KernelTuner
from tandem.engine.kv.kv_cache import PagedKVCache
from tandem.engine.model_config import ModelConfig
from tandem.engine.models.int4 import Int4Linear
from tandem.engine.models.int8 import Int8Linear
from tandem.engine.models.linear import Linear
from tandem.engine.models.mlp import GatedMLP
from tandem.engine.models.layer_ops import LayerOps
from tandem.engine.models.lora import LoRAOps, LoRASlots
from tandem.engine.models.moe import MoEBlock
from tandem.engine.models.projections import ProjectionBuilder, Weight
from tandem.engine.models.rope import RotaryEmbedding
from tandem.engine.parallel.layout import ParallelConfig, RankShard, ReplicaLayout

if TYPE_CHECKING:
    from tandem.engine.parallel.comm import ParallelComm

_log = logging.getLogger(__name__)


def expert_names(config: ModelConfig, layer: int, expert: int | None) -> tuple[str, str, str]:
    """Hugging Face names (gate, up, down, without ".weight") of one MLP: a layer's dense MLP (expert None),
    one of its experts, or (expert -1) its shared expert."""
    p = f"model.layers.{layer}."
    if expert is None:
        return p + "mlp.gate_proj", p + "mlp.up_proj", p + "mlp.down_proj"
    if config.architecture == "MixtralForCausalLM":
        e = p + f"block_sparse_moe.experts.{expert}."
        return e + "w1", e + "w3", e + "w2"
    e = p + ("mlp.shared_expert." if expert == -1 else f"mlp.experts.{expert}.")
    return e + "gate_proj", e + "up_proj", e + "down_proj"


def router_name(config: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def _mlp_shapes(names: tuple[str, str, str], hidden: int, columns: int, bias: bool) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    shapes = {gate + ".weight": (columns, hidden), up + ".weight": (columns, hidden), down + ".weight": (hidden, columns)}
    if bias:
        shapes |= {gate + ".bias": (columns,), up + ".bias": (columns,), down + ".bias": (hidden,)}
    return shapes


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
        }
        moe = config.moe
        if moe is not None and moe.sparse_layers[n]:
            shapes[router_name(config, n)] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes |= _mlp_shapes(expert_names(config, n, e), h, moe.intermediate_size, False)
            if moe.shared_intermediate_size:
                shapes |= _mlp_shapes(expert_names(config, n, -1), h, moe.shared_intermediate_size, False)
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        else:
            shapes |= _mlp_shapes(expert_names(config, n, None), h, i, config.mlp_bias)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,), p + "self_attn.k_norm.weight": (config.head_dim,)}
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (config.q_size,), p + "self_attn.k_proj.bias": (config.kv_size,),
                       p + "self_attn.v_proj.bias": (config.kv_size,)}
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, Weight], source: str) -> None:
    """Raises ModelLoadError naming the first missing tensor or the first whose shape disagrees with the config.
    Reads shapes only, never a LazyWeight's data."""
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
    qkv: Linear | Int4Linear  # [hidden] -> [q + 2 kv] (this rank's heads)
    o: Linear | Int4Linear
    mlp: GatedMLP | MoEBlock
    window: int | None
    q_norm: torch.Tensor | None = None  # [head_dim], Qwen3's per-head query/key norms
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class _EagerOps:
    """Weight products and attention as plain calls: what forward runs when the step is not compiled."""

    model: LlamaModel
    meta: AttentionMetadata
    kv_cache: PagedKVCache
    on_layer: Callable[[int], None] | None

    @staticmethod
    def project(projection: Linear | Int4Linear, x: torch.Tensor) -> torch.Tensor:
        return projection(x)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.model.attend(index, q, k, v, self.meta, self.kv_cache, self.on_layer)


class LlamaModel:
    """A decoder whose attention reads and writes K/V through block tables into a PagedKVCache.

    With a RankShard it holds one rank's part of a replica (engine/parallel/layout.py): its stage's layers, its
    query and KV heads, its share of MLP columns and its experts; `comm` all-reduces partial sums over the TP
    group and dispatches tokens over the EP group. Without one it is the whole model.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Weight], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None, source: str = "weights",
                 shard: RankShard | None = None, comm: ParallelComm | None = None, cpu: CpuFeatures | None = None,
                 tuner: KernelTuner | None = None, weight_format: str = "dense"):
        """Consumes `weights`: the entries this rank holds are popped (to keep peak memory low) and read, a
        LazyWeight only for the rows or columns of this rank's shard, straight into `dtype` on `device`; other
        stages' layers and other EP indices' experts stay in the dict, unread. How each projection is held
        (weight_format: engine_config.WEIGHT_FORMATS; packed Int4Weight entries) is the policy of
        engine/models/projections.py, which raises ValueError for a combination that cannot run. cpu: what the
        CPU runs, for the kernel choice (default: this process's probe; ignored off the CPU). tuner: times the
        candidate kernels of each projection shape and of decode attention on this CPU and keeps the fastest
        (default: as the environment says, engine/hardware/kernel_tuning.py; a disabled tuner keeps the probe's fixed
        choices). Raises ModelLoadError on bad shapes."""
        check_weights(config, weights, source)  # source names the checkpoint in errors
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = config.head_dim**-0.5
        self.comm = comm
        self.cpu = (cpu or cpu_features()) if self.device.type == "cpu" else None
        self.tuner = None
        if self.cpu is not None:
            self.tuner = tuner or KernelTuner.from_environment(self.cpu)
            if not self.tuner.enabled:
                self.tuner = None
        if shard is None:
            shard = ReplicaLayout.build(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                                        num_kv_heads=config.num_kv_heads, num_experts=config.num_experts).shard(0)
        self.shard = shard
        self.num_heads, self.num_kv_heads = len(shard.q_heads), len(shard.kv_heads)
        tp = 1 if comm is None else comm.tp_size
        self.weight_format = weight_format
        build = ProjectionBuilder(weights, dtype=dtype, device=self.device, cpu=self.cpu, tuner=self.tuner,
                                  weight_format=weight_format, tp=tp, tp_index=shard.tp_index)
        take, linear, mlp = build.take, build.linear, build.mlp

        expert_ranks = (0,) * config.num_experts if comm is None else comm.layout.expert_ranks
        d = config.head_dim
        q_rows = range(shard.q_heads.start * d, shard.q_heads.stop * d)
        kv_rows = range(shard.kv_heads.start * d, shard.kv_heads.stop * d)
        self.layers: list[_Layer] = []
        for n in shard.layers:
            p = f"model.layers.{n}."
            a = p + "self_attn."
            moe = config.moe
            if moe is not None and moe.sparse_layers[n]:
                shared = None
                if moe.shared_intermediate_size:
                    shared = mlp(expert_names(config, n, -1), moe.shared_intermediate_size)
                ffn: GatedMLP | MoEBlock = MoEBlock(
                    moe, take(router_name(config, n)),
                    {e: mlp(expert_names(config, n, e), moe.intermediate_size) for e in shard.experts},
                    expert_ranks, shared=shared,
                    shared_gate=take(p + "mlp.shared_expert_gate.weight") if shared else None, comm=comm,
                    ep_index=shard.ep_index, ep_size=1 if comm is None else comm.ep_size)
            else:
                ffn = mlp(expert_names(config, n, None), config.intermediate_size)
            self.layers.append(_Layer(
                input_norm=take(p + "input_layernorm.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                qkv=linear([a + "q_proj", a + "k_proj", a + "v_proj"], None if tp == 1 else [q_rows, kv_rows, kv_rows],
                           wide_input=True),
                o=linear([a + "o_proj"], columns=None if tp == 1 else q_rows),
                mlp=ffn,
                window=config.sliding_windows[n],
                q_norm=take(a + "q_norm.weight") if config.qk_norm else None,
                k_norm=take(a + "k_norm.weight") if config.qk_norm else None,
            ))
        self.embed = self.norm = self.lm_head = None
        tied = config.tie_word_embeddings
        if shard.is_first_stage or (shard.is_last_stage and tied):
            embed = build.embedding("model.embed_tokens.weight")
            self.embed = embed.to(dtype)
        if shard.is_last_stage:
            self.norm = take("model.norm.weight")
            # A tied head gets its own copy in the product layout; the embedding stays [vocab, hidden] for lookups.
            self.lm_head = build.dense(embed, None, head=True) if tied else linear(["lm_head"], head=True)
            if not shard.is_first_stage:
                self.embed = None
        positions = max_positions or config.max_position_embeddings
        self.rope = RotaryEmbedding(config.rope, config.head_dim, positions, dtype, self.device)
        if self.tuner is None or not self.num_kv_heads:
            self.decode_plan = fixed_decode_plan(self.cpu)
        else:
            self.decode_plan = tuned_decode_plan(self.tuner, dtype, self.num_kv_heads,
                                                 self.num_heads // self.num_kv_heads, config.head_dim)
        self.attention = TorchAttentionBackend()
        self.lora: LoRASlots | None = None  # LoRA adapters (engine/models/lora.py): set by the runner's builder
        _log.info("%s projections on %s by kernel: %s; decode attention: %s", dtype, self.device,
                  self.kernel_counts(), self.decode_plan.describe("sequence"))

    @property
    def attention(self) -> TorchAttentionBackend:
        return self._attention

    @attention.setter
    def attention(self, backend: TorchAttentionBackend) -> None:
        """A backend set later (the engine's select_backend) runs this model's decode plan too (on the path of
        tandem's CPU kernels the probe chose)."""
        backend.decode_plan = self.decode_plan
        backend.kernel_path = kernel_path(self.cpu) or 0
        self._attention = backend

    def projections(self) -> Iterator[Linear | Int4Linear | Int8Linear]:
        """Every weight product this rank runs: each layer's QKV, O and MLP (each expert's), then the LM head."""
        for layer in self.layers:
            yield layer.qkv
            yield layer.o
            mlps = [layer.mlp] if isinstance(layer.mlp, GatedMLP) else \
                list(layer.mlp.experts.values()) + ([layer.mlp.shared] if layer.mlp.shared else [])
            for mlp in mlps:
                yield mlp.gate_up
                yield mlp.down
        if self.lm_head is not None:
            yield self.lm_head

    def kernel_counts(self) -> dict[str, int]:
        """How many projections run on each plan (Linear.kernel describes one, "int4" names packed ones)."""
        return dict(Counter(p.kernel for p in self.projections()))

    def kernel_plans(self) -> dict[str, tuple[int, str]]:
        """Per weight shape ("960x576", [out x in]): how many projections have it, and their plan."""
        plans: dict[str, tuple[int, str]] = {}
        for p in self.projections():
            shape = f"{p.out_features}x{p.in_features}"
            plans[shape] = (plans.get(shape, (0, ""))[0] + 1, p.kernel)
        return plans

    def weight_bytes_per_token(self) -> int:
        """Bytes a batch-1 decode step reads: every projection, every norm and the LM head (the embedding
        lookup reads one row, which is negligible). For an MoE model, every expert (an upper bound)."""
        total = 0 if self.lm_head is None else self.lm_head.nbytes + self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            total += layer.qkv.nbytes + layer.o.nbytes + layer.mlp.nbytes
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * layer.input_norm.element_size()
            if layer.q_norm is not None:
                total += (layer.q_norm.numel() + layer.k_norm.numel()) * layer.q_norm.element_size()
        return total

    def weight_bytes(self) -> int:
        """Bytes of weights this model (or rank) holds: what it reads per token plus the embedding table."""
        embed = 0 if self.embed is None else self.embed.numel() * self.embed.element_size()
        return self.weight_bytes_per_token() + embed

    def expert_load(self) -> dict[int, int]:
        """(token, k) pairs each of this rank's experts computed since start, summed over its layers."""
        load: dict[int, int] = {}
        for layer in self.layers:
            if isinstance(layer.mlp, MoEBlock):
                for expert, count in layer.mlp.load.items():
                    load[expert] = load.get(expert, 0) + count
        return load

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # Lower precision: normalize in float32, round, then scale (the reference's order of operations).
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVCache, hidden: torch.Tensor | None = None,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64 (the batch's new tokens, flattened). A later pipeline stage passes
        the previous stage's output as `hidden` [T, hidden_size] instead of embedding input_ids. Returns the
        hidden states [T, hidden_size]: normed on the last stage, the residual stream on the others.

        Mutates kv_cache: each new token's K/V is written at meta.slot_mapping in every layer this rank holds.
        on_layer(global layer index) is called as soon as a layer's K/V is written (KV transfer sends it while
        the next layers compute). This is the eager step; engine/models/step.py's run_step chooses between it
        and a compiled one.
        """
        if int(positions.max()) >= self.rope.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the model's {self.rope.max_positions}")
        ops: LayerOps = _EagerOps(self, meta, kv_cache, on_layer)
        if self.lora is not None and self.lora.active:
            ops = LoRAOps(ops, self.lora)
        return self.run_layers(input_ids, positions, hidden, ops)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               kv_cache: PagedKVCache, on_layer: Callable[[int], None] | None) -> torch.Tensor:
        """Layer `index` (of this rank's) attention: writes k/v to its cache, tells on_layer, returns [T, Hq * D]."""
        layer = self.layers[index]
        out = self.attention.forward(q, k, v, kv_cache.layer(index), meta, self.scale, layer.window)
        if on_layer is not None:
            on_layer(self.shard.layers[index])
        return out

    def paged_step(self, meta: AttentionMetadata, kv_cache: PagedKVCache) -> PagedStep | None:
        """The paged kernel's arguments every layer shares where this step's attention runs on it in every layer
        (attention.takes_paged), else None. The compiled step calls the kernel with them instead of `attend`."""
        if not self.layers or not self.attention.takes_paged(meta, kv_cache.layer(0), self.dtype):
            return None
        windows = tuple(layer.window or 0 for layer in self.layers)
        return PagedStep.of(meta, self.scale, windows, self.attention.kernel_path)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
                   ops: LayerOps) -> torch.Tensor:
        """forward's body, with weight products and attention through `ops` (eager calls, or the custom ops a
        compiled step traces: engine/models/compiled.py)."""
        cfg = self.config
        t = positions.shape[0]
        hq, hk = self.num_heads, self.num_kv_heads
        q_size, kv_size = hq * cfg.head_dim, hk * cfg.head_dim
        cos, sin = self.rope.lookup(positions)
        h = self.embed[input_ids] if hidden is None else hidden
        fused = self.attention.fused  # Triton's fused norm and rotary kernels, or None (torch ops)
        pending = None  # the last MLP's output, added to h together with the next norm
        for index, layer in enumerate(self.layers):
            x, h = self._add_norm(h, pending, layer.input_norm, fused)
            qkv = ops.project(layer.qkv, x)
            qk = qkv[:, : q_size + kv_size].view(t, hq + hk, cfg.head_dim)
            if layer.q_norm is not None:
                q, k = qk.split([hq, hk], dim=1)
                qk = torch.cat([self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)], dim=1)
            # Q and K sit side by side in the fused output: rotate them in one pass.
            if fused is not None:
                qk = fused.rotary_(qk, positions, self.rope.cos, self.rope.signed_sin)
            else:
                qk = self.rope.rotate(qk, cos, sin)
            q, k = qk.split([hq, hk], dim=1)
            v = qkv[:, q_size + kv_size :].reshape(t, hk, cfg.head_dim)
            attn = ops.project(layer.o, ops.attend(index, q, k, v))
            x, h = self._add_norm(h, attn if self.comm is None else self.comm.all_reduce_tp(attn), layer.post_norm,
                                  fused)
            out = layer.mlp(x, ops.project) if isinstance(layer.mlp, GatedMLP) else layer.mlp(x)
            pending = out if self.comm is None or isinstance(layer.mlp, MoEBlock) else self.comm.all_reduce_tp(out)
        if self.norm is None:
            return h if pending is None else h + pending
        return self._add_norm(h, pending, self.norm, fused)[0]

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  fused) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + delta) * weight, h + delta), or of h alone when delta is None; one fused kernel when the
        attention backend brings them (the sum rounded to h's dtype either way)."""
        if fused is not None:
            return fused.rms_norm(h, weight, self.config.rms_norm_eps, delta)
        if delta is not None:
            h = h + delta
        return self._norm(h, weight), h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (already normed) -> float32 logits [N, vocab]. Last pipeline stage only."""
        return self.lm_head(hidden).float()


def build_model(config: ModelConfig, weights: dict[str, Weight], **kwargs) -> LlamaModel:
    """Instantiates the model class for config.architecture (every supported one is Llama-shaped, the MoE ones
    with MoEBlock MLPs)."""
    return LlamaModel(config, weights, **kwargs)
