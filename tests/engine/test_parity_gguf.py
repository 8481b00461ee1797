"""A GGUF written like llama.cpp writes one (permuted Q/K, seven tensor types): tandem vs transformers' own
GGUF loader on the same file."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.core.generator import Generator
from tandem.engine.loader import load_model
from tandem.engine.sampling_params import SamplingParams
from tests.engine.tiny_gguf import write_tiny_gguf
from tests.reference import hf_greedy


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_gguf_of_many_tensor_types_matches_transformers(tiny_gguf):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                    dtype=torch.float32).eval()
    loaded = load_model(tiny_gguf, progress=False)
    assert (loaded.config.num_heads, loaded.config.num_kv_heads) == (4, 2)
    assert not loaded.config.tie_word_embeddings
    generator = Generator(loaded, max_model_len=256)
    for text in ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n"]:
        ids = loaded.tokenizer.encode(text)
        expected_tokens, expected_logits = hf_greedy(hf_model, ids, 32)
        result = generator.generate(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        assert result.token_ids == expected_tokens
        assert (generator.prompt_logits(ids) - expected_logits).abs().max().item() < 1e-3


def test_packed_mode_mixes_packed_and_dense_projections(tiny_gguf):
    """Q (Q4_0) and K (Q4_1) are packable but V (Q5_0) is not, so the fused QKV must fall back to dense
    weights (no other projection of this file is 4-bit): the packed load equals the dense bfloat16 load."""
    from tandem.engine.models.int4 import Int4Linear
    from tandem.engine.models.linear import Linear

    packed = load_model(tiny_gguf, progress=False, weight_format="packed", dtype=torch.bfloat16)
    assert isinstance(packed.model.layers[0].qkv, Linear)
    dense = load_model(tiny_gguf, progress=False, dtype=torch.bfloat16)
    ids = dense.tokenizer.encode("Packed and dense weights agree.")
    a = Generator(packed, max_model_len=128).prompt_logits(ids)
    b = Generator(dense, max_model_len=128).prompt_logits(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not any(isinstance(layer.qkv, Int4Linear) for layer in packed.model.layers)
