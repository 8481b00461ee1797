"""Turns a batch of logits into next tokens: penalties, then greedy or filtered random sampling, and log-probs.

Order per row: repetition penalty (prompt + output tokens), presence/frequency penalties (output tokens), then
argmax when temperature == 0, else temperature, top-k, top-p, min-p and one random draw.

Determinism: the draw of a row depends only on its (seed, step) and its own distribution, never on the other
rows, the batch size, call order or torch's global RNG. Each row reseeds a torch.Generator with
splitmix64(seed, step) and picks argmax(probs / q) with q ~ Exp(1) per token (the "exponential race", an exact
draw from probs). A sequence recomputed after preemption, or batched with other neighbours, therefore gets the
same tokens, given the same device and torch version (CPU and CUDA generators give different streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Smallest value an Exp(1) draw is clamped to: keeps probs / q finite and never 0 / 0.
_TINY = torch.finfo(torch.float32).tiny
# top-p sorts only this many most likely tokens unless they hold less than top_p of the mass.
_TOP_P_CANDIDATES = 1024


@dataclass(frozen=True)
class SampleRequest:
    """One row of the batch to sample.

    seed is always set (the engine draws a random one for requests without params.seed). step is the index of
    the token being sampled in this sequence's output (0 = first generated token). output_token_ids are the
    tokens generated so far (normally step of them). Only penalties read the two histories: callers may pass
    empty ones for rows without penalties.
    """

    params: SamplingParams
    seed: int
    step: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]

    @classmethod
    def after(cls, params: SamplingParams, seed: int, token_ids: Sequence[int], num_prompt_tokens: int,
              proposed: Sequence[int] = ()) -> SampleRequest:
        """The row of the token after token_ids (prompt then outputs) and any proposed tokens after them; the
        histories only where penalties read them (no copy every step otherwise)."""
        step = len(token_ids) + len(proposed) - num_prompt_tokens
        if not params.has_penalties:
            return cls(params, seed, step, (), ())
        return cls(params, seed, step, token_ids[:num_prompt_tokens], [*token_ids[num_prompt_tokens:], *proposed])


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int) -> int:
    """The 64-bit generator seed of one draw: a mix of (seed, step), so nearby seeds and steps are unrelated."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def sample_batch(logits: torch.Tensor, rows: Sequence[SampleRequest]) -> list[SampledToken]:
    """logits: float32 [len(rows), vocab] (other float dtypes are converted). Returns one SampledToken per row,
    in order. Does not modify logits. Raises ValueError when the shape does not match rows."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows), vocab] = [{len(rows)}, vocab], got {list(logits.shape)}")
    if not rows:
        return []
    logits = logits.float()
    params = [r.params for r in rows]
    if all(p.greedy and not p.has_penalties and p.logprobs is None for p in params):
        return [SampledToken(t, None, ()) for t in logits.argmax(dim=-1).tolist()]

    processed = apply_penalties(logits, rows)
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        token_ids[greedy] = _take(processed, greedy).argmax(dim=-1)
    if sampled:
        probs = _filtered_probs(_take(processed, sampled), [params[i] for i in sampled])
        token_ids[sampled] = _exponential_race(probs, [row_seed(rows[i].seed, rows[i].step) for i in sampled])
    logprobs = _logprobs(logits, token_ids, params)
    return [SampledToken(t, *logprobs.get(i, (None, ()))) for i, t in enumerate(token_ids.tolist())]


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's given rows; x itself (no copy) when rows are all of them, in order."""
    return x if rows == list(range(x.shape[0])) else x[rows]


def _cells(seqs: list[tuple[int, Sequence[int]]], vocab: int, device: torch.device) -> torch.Tensor:
    """Flat indices row * vocab + token into a [rows, vocab] tensor, one per token of each (row, tokens) pair."""
    tokens = torch.tensor([t for _, seq in seqs for t in seq], dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor([r for r, _ in seqs], dtype=torch.long),
                                  torch.tensor([len(seq) for _, seq in seqs], dtype=torch.long))
    return (row * vocab + tokens).to(device)


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _per_row(values, device).unsqueeze(1)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """logits [len(rows), vocab] with every row's penalties applied: a new tensor when some row has penalties,
    else logits itself (never modified).

    Repetition (HF/vLLM): logits of tokens seen in prompt or output are divided by the penalty when positive,
    multiplied when negative. Presence/frequency (OpenAI): logit -= presence * (count > 0) + frequency * count,
    counting output tokens only. Only the logits of tokens that occur are touched, so the cost grows with the
    number of tokens, not with rows x vocab.
    """
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    add = [i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
    if not rep and not add:
        return logits
    out, vocab, device = logits.clone(), logits.shape[1], logits.device
    flat = out.view(-1)
    if rep:
        # A token seen twice appears twice in cells; both writes store the same value, so no dedup is needed.
        cells = _cells([(i, (*rows[i].prompt_token_ids, *rows[i].output_token_ids)) for i in rep], vocab, device)
        penalty = _per_row([r.params.repetition_penalty for r in rows], device)[cells // vocab]
        seen = flat[cells]
        flat[cells] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if add:
        # sort + unique_consecutive: torch.unique is many times slower on the CPU.
        cells = _cells([(i, rows[i].output_token_ids) for i in add], vocab, device).sort().values
        cells, counts = torch.unique_consecutive(cells, return_counts=True)
        row = cells // vocab
        presence = _per_row([r.params.presence_penalty for r in rows], device)[row]
        frequency = _per_row([r.params.frequency_penalty for r in rows], device)[row]
        flat[cells] -= presence + frequency * counts
    return out


def _on_rows(x: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x with fn applied to the given rows (all rows without indexing when rows covers them)."""
    if len(rows) == x.shape[0]:
        return fn(x)
    x[rows] = fn(x[rows])
    return x


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keeps each row's ks[i] largest logits (ties with the k-th are kept too)."""
    kth = x.topk(max(ks), dim=-1).values.gather(1, torch.tensor(ks, device=x.device).unsqueeze(1) - 1)
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keeps each row's smallest set of most likely tokens whose probability mass reaches top_p (at least one).

    Only the _TOP_P_CANDIDATES most likely tokens are sorted; a row whose candidates do not reach top_p (a very
    flat distribution) falls back to a full-vocabulary sort. Which of two exactly tied tokens at the boundary
    survives is unspecified, but the same for the same row.
    """
    probs = torch.softmax(x, dim=-1)
    threshold = _column(top_p, x.device)
    values, ids = probs.topk(min(_TOP_P_CANDIDATES, x.shape[1]), dim=-1)
    mass_before = _mass_before(values)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, mass_before < threshold)
    out = x.masked_fill(~keep, float("-inf"))
    if values.shape[1] < x.shape[1]:
        candidates_mass = mass_before[:, -1] + values[:, -1]
        flat = (candidates_mass < threshold.squeeze(1)).nonzero().squeeze(1).tolist()
        if flat:
            sorted_probs, order = probs[flat].sort(dim=-1, descending=True, stable=True)
            keep_sorted = _mass_before(sorted_probs) < threshold[flat]
            out[flat] = x[flat].masked_fill(~torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted),
                                            float("-inf"))
    return out


def _mass_before(sorted_probs: torch.Tensor) -> torch.Tensor:
    """[rows, n]: the probability mass of the tokens ranked before each one (0 for the first)."""
    cum = sorted_probs.cumsum(dim=-1)
    return torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)


def _min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the row's highest probability."""
    probs = torch.softmax(x, dim=-1)
    threshold = _column(min_p, x.device) * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < threshold, float("-inf"))


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sampling probabilities [rows, vocab] after temperature, top-k, top-p and min-p. logits is not modified.

    Rows that disable a filter skip it, so no full-vocabulary sort happens unless some row has top_p < 1.
    """
    x = logits / _column([p.temperature for p in params], logits.device)
    vocab = x.shape[1]
    k_rows = [i for i, p in enumerate(params) if p.top_k_enabled and p.top_k < vocab]
    if k_rows:
        x = _on_rows(x, k_rows, lambda sub: _top_k(sub, [params[i].top_k for i in k_rows]))
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        x = _on_rows(x, p_rows, lambda sub: _top_p(sub, [params[i].top_p for i in p_rows]))
    m_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if m_rows:
        x = _on_rows(x, m_rows, lambda sub: _min_p(sub, [params[i].min_p for i in m_rows]))
    return torch.softmax(x, dim=-1)


def _exponential_race(probs: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """One token per row drawn from probs: argmax(probs / q), q ~ Exp(1) from a generator seeded with seeds[i].

    q is -log(u) with u uniform: the same distribution as exponential_(), several times faster on the CPU.
    """
    u = torch.empty_like(probs)
    generator = torch.Generator(device=probs.device)
    for i, seed in enumerate(seeds):
        generator.manual_seed(seed)
        u[i].uniform_(generator=generator)
    q = u.log_().neg_().clamp_min_(_TINY)  # u == 0 gives q = inf: that token just cannot win
    return (probs / q).argmax(dim=-1)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
              params: list[SamplingParams]) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """{row: (logprob of its token, top logprobs)} for the rows that asked, from the raw logits."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return {}
    log_probs = torch.log_softmax(_take(logits, rows), dim=-1)
    chosen = log_probs.gather(1, _take(token_ids, rows).unsqueeze(1)).squeeze(1).tolist()
    k_max = min(max(params[i].logprobs for i in rows), log_probs.shape[1])
    top_values, top_ids = ([], []) if k_max == 0 else (t.tolist() for t in log_probs.topk(k_max, dim=-1))
    result = {}
    for n, i in enumerate(rows):
        k = params[i].logprobs
        top = tuple(zip(top_ids[n][:k], top_values[n][:k])) if k else ()
        result[i] = (chosen[n], top)
    return result
