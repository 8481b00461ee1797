"""Parsing Hugging Face config.json variants into ModelConfig."""

from __future__ import annotations

import pytest

from tandem.engine.errors import ModelLoadError, UnsupportedModelError
from tandem.engine.model_config import model_config_from_hf

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_older_rope_scaling_keys_are_read():
    cfg = model_config_from_hf(BASE | {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("llama3", 500000.0, 32.0)
    legacy = model_config_from_hf(BASE | {"rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (legacy.rope.rope_type, legacy.rope.factor, legacy.rope.theta) == ("linear", 4.0, 10000.0)


def test_unknown_rope_scaling_is_rejected():
    with pytest.raises(UnsupportedModelError, match="rope scaling 'yarn' is not supported"):
        model_config_from_hf(BASE | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen2_biases_and_sliding_window_rules():
    qwen = dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=32, max_window_layers=1)
    assert model_config_from_hf(qwen).sliding_windows == (None, None)  # use_sliding_window defaults to false
    windowed = model_config_from_hf(qwen | {"use_sliding_window": True})
    assert windowed.sliding_windows == (None, 32) and windowed.qkv_bias and not windowed.o_bias


def test_layer_types_must_cover_every_layer():
    mistral = dict(BASE, architectures=["MistralForCausalLM"], sliding_window=16)
    assert model_config_from_hf(mistral).sliding_windows == (16, 16)
    with pytest.raises(ModelLoadError, match="3 sliding-window entries"):
        model_config_from_hf(mistral | {"layer_types": ["sliding_attention"] * 3})


def test_missing_key_and_bad_head_counts():
    broken = dict(BASE)
    del broken["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing the required key 'hidden_size'"):
        model_config_from_hf(broken)
    with pytest.raises(ModelLoadError, match="must be a multiple of num_key_value_heads"):
        model_config_from_hf(BASE | {"num_key_value_heads": 3})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        model_config_from_hf(BASE | {"hidden_act": "gelu"})
