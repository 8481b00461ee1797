"""Verifying proposed tokens so that the output follows the target model's distribution exactly (speculative
sampling, Leviathan et al. 2023; Chen et al. 2023).

For one sequence, k proposed tokens x_1..x_k and the target's distributions p_1..p_{k+1} at the k+1 positions (the
last one after all proposals), with the proposer's distributions q_1..q_k (a deterministic proposer such as n-gram
lookup: q_i is one-hot on x_i):
  for i = 1..k: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection, emit a token drawn
  from the residual norm(max(0, p_i - q_i)) and stop;
  if all k are accepted, emit a bonus token drawn from p_{k+1}.
Each emitted token is then distributed as the target alone would have drawn it. Greedy (temperature 0): accept while
x_i is the target's argmax; the first mismatch emits the argmax; all accepted emit the argmax after them. Greedy
output is therefore identical to decoding without speculation.

What the engine runs for every proposer, `accept_drawn`: the sampler draws
the target's own token y_i at each of the k + 1 positions with the seed of the output step it decides (as it would
without speculation), and x_i is accepted while y_i == x_i; the first y_i that differs is emitted and ends the step,
and when all match, y_{k+1} is the bonus. That is the rule above with coupled randomness: x_i is accepted with
probability p_i(x_i) = min(1, p_i(x_i) / 1), and a rejected step emits y_i conditioned on y_i != x_i, which is the
residual norm(max(0, p_i - q_i)) (for the n-gram and suffix proposers, whose q is one-hot). Since every emitted token
is the draw the request's seed gives at that step, the output is token for token the output without speculation,
sampled or greedy, whatever was proposed. The draft model (engine/decoding/draft_proposer.py) draws its proposals with
the same seeds from its own distribution q, so x_i == y_i wherever q_i and p_i put the draw on the same token: its
acceptance is that coupling's, close to min(1, p/q)'s when q is close to p, and the output stays the target's own.

`verify_sampled` (independent acceptance draws) is the textbook rule for a proposer with a distribution q; the engine
does not run it (it would give up that identity), and tests/engine/decoding/test_speculative_parts.py checks it keeps
the target distribution. Its draws come from generators seeded by (the request's seed, the output step it decides, and
which draw it is), as engine/decoding/sampler.py seeds its draws, so the same seed and proposals give the same tokens on
any batch.

Torch, CPU or GPU: probabilities are the target's after temperature, top-k/p and min-p (sampler._filtered_probs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch

from tandem.engine.decoding.sampler import _exponential_race, row_seed
from tandem.engine.sampled_token import SampledToken

T = TypeVar("T", int, SampledToken)

_ACCEPT_STREAM = 0x5EC0_1D5A_17ED  # keeps the acceptance draws apart from the token draws of the same step


@dataclass(frozen=True)
class Verified:
    """The tokens a step emits for one sequence: the accepted proposals, then one more (a correction or the bonus).
    num_accepted: how many proposals were accepted (len(tokens) - 1)."""

    tokens: tuple[int, ...]
    num_accepted: int


def accept_drawn(proposed: Sequence[int], drawn: Sequence[T]) -> tuple[T, ...]:
    """The tokens a step emits for one sequence, from the target's own draws at its len(proposed) + 1 positions
    (token ids, or SampledTokens): the proposals while each equals the draw at its position, then the first draw
    that differs, or the bonus draw after them all. Raises ValueError when the counts do not fit."""
    if len(drawn) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposals need {len(proposed) + 1} draws, got {len(drawn)}")
    ids = [d if isinstance(d, int) else d.token_id for d in drawn]
    accepted = 0
    while accepted < len(proposed) and proposed[accepted] == ids[accepted]:
        accepted += 1
    return tuple(drawn[:accepted + 1])


def verify_greedy(target_logits: torch.Tensor, proposed: Sequence[int]) -> Verified:
    """target_logits: [len(proposed) + 1, vocab]. The greedy case of accept_drawn: the draws are the argmaxes."""
    tokens = accept_drawn(proposed, target_logits.argmax(dim=-1).tolist())
    return Verified(tokens, len(tokens) - 1)


def _draw(probs: torch.Tensor, seed: int) -> int:
    """One token from probs [vocab], drawn as the sampler draws (its exponential race, seeded by `seed`)."""
    return int(_exponential_race(probs.unsqueeze(0), [seed])[0])


def _uniform(seed: int, device: torch.device) -> float:
    gen = torch.Generator(device=device).manual_seed(seed)
    return float(torch.rand((), generator=gen, device=device))


def verify_sampled(target_probs: torch.Tensor, proposed: Sequence[int], seed: int, step: int,
                   draft_probs: torch.Tensor | None = None) -> Verified:
    """target_probs: [len(proposed) + 1, vocab], each row a distribution. draft_probs: [len(proposed), vocab], the
    proposer's distributions, or None for a deterministic proposer (one-hot on its tokens). step: the output index
    of the first proposed token. Raises ValueError for shapes that do not fit."""
    k = len(proposed)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [{k + 1}, vocab], got {list(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, {target_probs.shape[1]}], got {list(draft_probs.shape)}")
    for i, token in enumerate(proposed):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        ratio = float(p[token]) / q_token if q_token > 0 else 0.0
        if _uniform(row_seed(seed ^ _ACCEPT_STREAM, step + i), p.device) < min(1.0, ratio):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0
        else:
            residual = (p - draft_probs[i]).clamp_min_(0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p  # p == q: any rejection is a draw from p
        return Verified(tuple(proposed[:i]) + (_draw(residual, row_seed(seed, step + i)),), i)
    return Verified(tuple(proposed) + (_draw(target_probs[k], row_seed(seed, step + k)),), k)
