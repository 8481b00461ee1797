"""The embedded SmolLM2-135M-Instruct GGUF: tandem vs transformers loading the same file in float32."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampling_params import SamplingParams
from tests.reference import hf_greedy

NUM_TOKENS = 32

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
    "faster than scribes. Within a few decades presses spread across Europe, from Mainz to Venice to London, "
    "and the price of books fell sharply. Literacy rose, scientific results could be shared exactly, and the "
    "Reformation used pamphlets to spread its arguments. "
) * 3

PROMPTS = {
    "chat_short": {"chat": "What is the capital of France?"},
    "chat_code": {"chat": "Write a Python function that checks whether a number is prime."},
    "chat_french": {"chat": "Explique-moi en deux phrases pourquoi le ciel est bleu."},
    "raw_code": {"raw": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    "raw_german": {"raw": "Die Hauptstadt von Deutschland ist"},
    "raw_chinese": {"raw": "北京是中国的首都，它的历史"},
    "chat_long": {"chat": "Summarize this text in one sentence:\n\n" + LONG_TEXT},
}


def _prompt_ids(tokenizer, spec) -> list[int]:
    if "chat" in spec:
        return tokenizer.encode_chat([{"role": "user", "content": spec["chat"]}])
    return tokenizer.encode(spec["raw"])


@pytest.mark.reference
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_tokens_and_logits_match_transformers(name, embedded, embedded_generator, hf_embedded):
    hf_model, _ = hf_embedded
    ids = _prompt_ids(embedded.tokenizer, PROMPTS[name])
    if name == "chat_long":
        assert len(ids) >= 300
    expected_tokens, expected_logits = hf_greedy(hf_model, ids, NUM_TOKENS)

    result = embedded_generator.generate(ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    logits = embedded_generator.prompt_logits(ids)

    assert result.token_ids == expected_tokens
    assert (logits - expected_logits).abs().max().item() < 1e-3
    assert embedded_generator.block_pool.num_free == embedded_generator.block_pool.num_blocks
    embedded_generator.block_pool.check_integrity()


@pytest.mark.reference
def test_chat_prompt_ids_match_transformers_template(embedded, hf_embedded):
    _, hf_tokenizer = hf_embedded
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert embedded.tokenizer.encode_chat(messages) == list(expected)


def test_embedded_model_shape(embedded):
    cfg = embedded.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings
    assert embedded.model.dtype == torch.float32
