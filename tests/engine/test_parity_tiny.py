"""Tiny random Llama 3, Llama 2 (linear RoPE, tied, MQA), Qwen2 (qkv bias) and Mistral (sliding window)
checkpoints, loaded from sharded safetensors folders: tandem vs transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.core.generator import Generator
from tandem.engine.loader import load_model
from tandem.engine.sampling_params import SamplingParams
from tests.engine.tiny_models import CONFIGS, write_tiny_model
from tests.reference import hf_greedy

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 6, "def add(a, b):\n    return", "日本語のテキスト"]


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_tiny_model_matches_transformers(kind, tmp_path, embedded):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(tmp_path / kind, kind, embedded.tokenizer)
    assert len(list(folder.glob("*.safetensors"))) > 1, "the test must exercise sharded checkpoints"
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(folder, progress=False)
    generator = Generator(loaded, max_model_len=256)
    for text in PROMPTS:
        ids = loaded.tokenizer.encode(text)
        if kind == "mistral_sliding_window" and text.startswith("The quick"):
            assert len(ids) + 32 > 2 * CONFIGS[kind][2]["sliding_window"], "the window must be exercised"
        expected_tokens, expected_logits = hf_greedy(hf_model, ids, 32)
        result = generator.generate(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        assert result.token_ids == expected_tokens, text
        assert (generator.prompt_logits(ids) - expected_logits).abs().max().item() < 1e-3
    generator.block_pool.check_integrity()
