"""The accuracy gate of the quantized modes, on the embedded model and a public-domain text the repo ships
(bench/data/public_domain.txt, ~2,900 tokens): perplexity against float32's (int8 weights within 1%, int8 KV
within 2%, fp8 KV within 3%), greedy agreement with float32 on the parity prompts, and proof that the gate can
fail: int8 KV pages with every scale forced to 1 break it. bench/quantization.py reports the same numbers.

Greedy agreement is reported, and held to bfloat16's: this 135M model meets near-ties on several parity prompts
(plain bfloat16 weights and KV keep float32's first 16 tokens on 3 of the 7), so a quantized mode must agree on
at least as many prompts as bfloat16 does, less one.

Every model here runs the CPU probe's fixed kernels (TANDEM_KERNEL_TUNING=off, the suite's setting in
tests/conftest.py), the shared float32 reference included:
near-ties flip with the summation order, and the tuner's choice of kernel, timed on the machine at hand, changed
bfloat16's agreement from run to run on one AVX2 machine (5/7 in one run, where int8 KV's 3/7 then failed the
gate; 3/7 with the fixed kernels, where int8 KV agrees on 4/7)."""

from __future__ import annotations

import pytest
import torch

import tandem.engine.attention.kv_quant as kv_quant
from bench.quantization import AGREEMENT_TOKENS, agreement, greedy_tokens, load, parity_prompts, text_perplexity

GATES = {"int8 weights": 1.01, "int8 KV": 1.02, "fp8 KV": 1.03}
KV_DTYPES = {"int8 KV": torch.int8, "fp8 KV": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def float32_reference(embedded):
    """float32 weights and KV: the perplexity and greedy tokens every mode is held to."""
    return text_perplexity(embedded, torch.float32), greedy_tokens(embedded, "auto", parity_prompts(embedded.tokenizer))


@pytest.fixture(scope="module")
def bfloat16_agreement(float32_reference) -> int:
    """On how many parity prompts plain bfloat16 (weights and KV) keeps float32's first 16 greedy tokens."""
    loaded = load("bfloat16")
    agreed = agreement(float32_reference[1], greedy_tokens(loaded, "auto", parity_prompts(loaded.tokenizer)))
    print(f"bfloat16: first {AGREEMENT_TOKENS} greedy tokens equal float32's on "
          f"{sum(a >= AGREEMENT_TOKENS for a in agreed)}/{len(agreed)} parity prompts ({agreed})")
    return sum(a >= AGREEMENT_TOKENS for a in agreed)


@pytest.mark.parametrize("mode", list(GATES))
def test_each_quantized_mode_keeps_perplexity_within_its_gate(mode, embedded, float32_reference,
                                                              bfloat16_agreement):
    baseline, reference_tokens = float32_reference
    loaded = load("int8 weights") if mode == "int8 weights" else embedded
    kv = KV_DTYPES.get(mode, torch.bfloat16)
    ratio = text_perplexity(loaded, kv).ratio(baseline)
    print(f"{mode}: perplexity {ratio:.4f}x float32's ({baseline.value:.3f})")
    assert ratio <= GATES[mode]
    kv_name = {"int8 KV": "int8", "fp8 KV": "fp8_e4m3"}.get(mode, "auto")
    agreed = agreement(reference_tokens, greedy_tokens(loaded, kv_name, parity_prompts(loaded.tokenizer)))
    full = sum(a >= AGREEMENT_TOKENS for a in agreed)
    print(f"{mode}: first {AGREEMENT_TOKENS} greedy tokens equal float32's on {full}/{len(agreed)} parity prompts "
          f"(agreed tokens per prompt: {agreed})")
    assert full >= bfloat16_agreement - 1


def test_the_gate_fails_when_kv_scales_are_forced_to_one(embedded, float32_reference, monkeypatch):
    """Scales that are not the data's (the failure vLLM #19292 and TensorRT-LLM #16916 met in the field) must not
    pass: int8 codes of unit scale round every K/V value to an integer."""
    baseline, _ = float32_reference
    monkeypatch.setattr(kv_quant, "data_scales", lambda peak, dtype: torch.ones_like(peak))
    ratio = text_perplexity(embedded, torch.int8).ratio(baseline)
    print(f"int8 KV with unit scales: perplexity {ratio:.2f}x float32's")
    assert ratio > GATES["int8 KV"] * 2
