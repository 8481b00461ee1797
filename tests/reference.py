"""The reference decode loop on a transformers model: plain forward + argmax, no logits processors."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Returns (greedy tokens, float32 logits at the prompt's last position)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    first_logits = out.logits[0, -1].float()
    past, logits = out.past_key_values, first_logits
    tokens: list[int] = []
    for _ in range(num_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return tokens, first_logits
