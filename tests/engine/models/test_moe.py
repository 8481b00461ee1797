"""Mixture-of-experts models: config parsing, and tests that a routing bug could not hide behind identical
experts. Output parity with transformers is in test_parity_tiny.py (the MoE kinds of tiny_models.CONFIGS)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.loader import load_checkpoint
from tandem.engine.model_config import model_config_from_hf
from tandem.engine.models import build_model
from tandem.engine.models.llama import expert_names, router_name
from tandem.engine.models.moe import MoEBlock
from tandem.engine.runner.model_runner import ModelRunner, SequenceChunk
from tests.engine.tiny_models import write_tiny_model

BASE = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)


def test_qwen_moe_config_reads_sparse_step_dense_layers_and_renormalization():
    cfg = model_config_from_hf(BASE | dict(architectures=["Qwen2MoeForCausalLM"], num_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                           decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True))
    assert cfg.moe.sparse_layers == (False, True, False, False)
    assert cfg.moe.renormalize and cfg.moe.shared_intermediate_size == 24 and cfg.qkv_bias


def test_mixtral_config_always_renormalizes_and_has_no_shared_expert():
    cfg = model_config_from_hf(BASE | dict(architectures=["MixtralForCausalLM"], num_local_experts=4,
                                           num_experts_per_tok=2))
    assert cfg.moe.renormalize and cfg.moe.shared_intermediate_size == 0 and cfg.moe.sparse_layers == (True,) * 4
    assert cfg.moe.intermediate_size == 64 and not cfg.qkv_bias


def test_qwen3_moe_config_reads_either_expert_count_key_and_has_query_key_norms():
    for key in ("num_experts", "num_local_experts"):
        cfg = model_config_from_hf(BASE | {"architectures": ["Qwen3MoeForCausalLM"], key: 8, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": 16, "norm_topk_prob": True})
        assert cfg.moe.num_experts == 8 and cfg.moe.renormalize and cfg.qk_norm and not cfg.qkv_bias


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe_checkpoint(request, embedded, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, embedded.tokenizer)


def _logits(folder, ids, edit=None):
    checkpoint = load_checkpoint(folder, progress=False)
    if edit:
        edit(checkpoint)
    model = build_model(checkpoint.config, checkpoint.weights)
    spec = KVCacheSpec(model.config.num_layers, 8, 16, model.config.num_kv_heads, model.config.head_dim, torch.float32)
    runner = ModelRunner(model, PagedKVCache(spec))
    return runner.execute([SequenceChunk(tuple(ids), 0, tuple(range(8)))])[0], model


def test_experts_differ_every_expert_is_used_and_routing_changes_the_output(moe_checkpoint, embedded):
    ids = embedded.tokenizer.encode("Routing must matter: " + "the quick brown fox jumps over the lazy dog " * 4)
    base, model = _logits(moe_checkpoint, ids)
    config = model.config
    checkpoint = load_checkpoint(moe_checkpoint, progress=False)
    downs = [checkpoint.weights[expert_names(config, 0, e)[2] + ".weight"].materialize()
             for e in range(config.moe.num_experts)]
    assert min((a - b).abs().max().item() for i, a in enumerate(downs) for b in downs[i + 1:]) > 0.05
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    assert blocks and set().union(*(block.load for block in blocks)) == set(range(config.moe.num_experts))
    assert all(len(block.load) > config.moe.num_experts // 2 for block in blocks), "routing collapsed"
    assert sum(model.expert_load().values()) == len(ids) * config.moe.top_k * len(blocks)

    def swap_router_rows(ckpt):  # route expert 0's tokens to expert 1 and back, in every MoE layer
        for n in range(config.num_layers):
            if config.moe.sparse_layers[n]:
                w = ckpt.weights[router_name(config, n)] = ckpt.weights[router_name(config, n)].materialize()
                w[[0, 1]] = w[[1, 0]]

    swapped, _ = _logits(moe_checkpoint, ids, swap_router_rows)
    assert (swapped - base).abs().max().item() > 1e-2
