"""A profile: what a deployment's engines cost on one machine, measured by `tandem profile` (cluster/profiler.py) and
read by whatever chooses a deployment. One JSON file (PROFILE_VERSION): the machine, the model, and for each pool
of the profiled manifest its layout and limits, the points measured and the lines fitted to them:

    decode step(b sequences, c tokens of context each) = step_s + b * (decode_token_s + context_token_s * c)
    prefill(p prompts of n tokens, together) = step_s * steps + prefill_token_s * p * n
                                               + prefill_pair_s * p * n * (n + 1) / 2

steps: the scheduler steps the prompts take (ceil(p * n / max_num_batched_tokens)); the pair term is attention's
share of a prompt, which grows with the square of its length (each token attends to those before it). A KV transfer
of n tokens costs n * kv_bytes_per_token / transfer.bytes_per_s.

Plain Python and pydantic (numpy for the fits): no torch, no engine. A profile recorded on one machine (a GPU's)
is read anywhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.router.mocks.batching import StepCosts

PROFILE_VERSION = 1
UCX_LOOPBACK_BYTES_PER_S = 1.7e9  # DESIGN.md section 4: UCX over tcp/lo with 512 KB-2 MB segments


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillPoint(_Strict):
    """`prompts` prompts of prompt_tokens tokens each, submitted together: seconds until every first token, in
    `steps` engine steps."""

    prompt_tokens: int = Field(ge=1)
    prompts: int = Field(ge=1)
    steps: int = Field(ge=1)
    seconds: float = Field(gt=0)


class DecodePoint(_Strict):
    """One decode step of `batch` sequences with about `context` tokens each (the median of the steps timed)."""

    batch: int = Field(ge=1)
    context: int = Field(ge=1)
    seconds: float = Field(gt=0)


class Fit(_Strict):
    """The lines of the module docstring (seconds; none negative). decode_error / prefill_error: the points' root
    mean square relative error against them (0.1: predictions off by about 10%)."""

    step_s: float = Field(ge=0)
    decode_token_s: float = Field(ge=0)
    context_token_s: float = Field(ge=0)
    prefill_token_s: float = Field(ge=0)
    prefill_pair_s: float = Field(ge=0)
    decode_error: float = Field(ge=0)
    prefill_error: float = Field(ge=0)

    def decode_step(self, batch: int, context: float) -> float:
        """Seconds of one decode step of `batch` sequences of `context` tokens each."""
        return self.step_s + batch * (self.decode_token_s + self.context_token_s * context)

    def prefill(self, prompt_tokens: int, prompts: int, max_num_batched_tokens: int) -> float:
        """Seconds to prefill `prompts` prompts of prompt_tokens tokens together, chunked by the token budget."""
        steps = math.ceil(prompts * prompt_tokens / max_num_batched_tokens)
        return (self.step_s * steps + self.prefill_token_s * prompts * prompt_tokens
                + self.prefill_pair_s * prompts * prompt_tokens * (prompt_tokens + 1) / 2)


class Layout(_Strict):
    """How the pool's replicas run: parallel layout, device, dtype, weight format, CPU threads per replica, and
    whether its decode step was compiled."""

    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    ep: int = Field(ge=1)
    device: str
    dtype: str
    weights: str
    threads: int = Field(ge=1)
    compiled: bool


class PoolProfile(_Strict):
    layout: Layout
    block_size: int = Field(ge=1)
    num_kv_blocks: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)
    prefill: tuple[PrefillPoint, ...] = Field(min_length=2)
    decode: tuple[DecodePoint, ...] = Field(min_length=2)
    fit: Fit


class Transfer(_Strict):
    """The KV transport's rate between a prefill and a decode replica, and where the figure comes from."""

    bytes_per_s: float = Field(gt=0)
    source: str


class Profile(_Strict):
    """manifest / manifest_yaml: the profiled manifest's path and its text (what a plan made elsewhere from this
    profile starts from); mode: its mode, which says what its pools do (disaggregated: prefill and decode;
    colocated: one pool that prefills and decodes)."""

    version: Literal[1] = PROFILE_VERSION
    machine: str  # the CPU (model, flags, cores) or GPU it was measured on
    model: str
    manifest: str
    manifest_yaml: str
    mode: Literal["disaggregated", "colocated"]
    created: str  # ISO 8601, UTC
    pools: dict[str, PoolProfile] = Field(min_length=1)
    transfer: Transfer

    def pool(self, name: str) -> PoolProfile:
        """Raises ValueError naming the profiled pools when `name` is not one."""
        if name not in self.pools:
            raise ValueError(f"the profile has no pool {name!r}; it has {', '.join(sorted(self.pools))}")
        return self.pools[name]

    def step_costs(self, name: str, *, max_num_seqs: int | None = None) -> StepCosts:
        """The batching mock's costs (router/mocks/batching.py) of pool `name`: its fitted lines, KV bytes, the
        transfer rate and its budgets (max_num_seqs: another sequence cap than the profiled one)."""
        p = self.pool(name)
        f = p.fit
        return StepCosts(step_s=f.step_s, decode_token_s=f.decode_token_s, context_token_s=f.context_token_s,
                         prefill_token_s=f.prefill_token_s, prefill_pair_s=f.prefill_pair_s,
                         kv_bytes_per_token=p.kv_bytes_per_token, transfer_bytes_per_s=self.transfer.bytes_per_s,
                         max_num_batched_tokens=p.max_num_batched_tokens,
                         max_num_seqs=max_num_seqs or p.max_num_seqs)


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a column whose coefficient comes out negative is dropped (its
    coefficient 0) and the rest refitted, until none is."""
    keep = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while keep:
        solved = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if (solved >= 0).all():
            coef[keep] = solved
            break
        keep = [k for k, c in zip(keep, solved) if c >= 0]
    return coef


def _relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    return float(np.sqrt(np.mean([((p - m) / m) ** 2 for p, m in zip(predicted, measured)])))


def fit_points(prefill: Sequence[PrefillPoint], decode: Sequence[DecodePoint], max_num_batched_tokens: int) -> Fit:
    """The lines through the points, by relative least squares (each point weighs by its own size, so that short
    steps count as much as long ones). Raises ValueError when the points cannot separate the terms: decode points
    need two batch sizes and two contexts, prefill points two prompt lengths."""
    if len({p.batch for p in decode}) < 2 or len({p.context for p in decode}) < 2:
        raise ValueError("decode points need at least two batch sizes and two contexts to fit")
    if len({p.prompt_tokens for p in prefill}) < 2:
        raise ValueError("prefill points need at least two prompt lengths to fit")
    rows = np.array([[1.0, p.batch, p.batch * p.context] for p in decode])
    times = np.array([p.seconds for p in decode])
    step_s, decode_token_s, context_token_s = _nonnegative_lstsq(rows / times[:, None], np.ones(len(decode)))
    # Prefill: the per-step cost is the decode fit's; the prompt's own terms are fitted to what remains.
    rows = np.array([[p.prompts * p.prompt_tokens, p.prompts * p.prompt_tokens * (p.prompt_tokens + 1) / 2]
                     for p in prefill])
    left = np.array([max(p.seconds - step_s * p.steps, 1e-9) for p in prefill])
    prefill_token_s, prefill_pair_s = _nonnegative_lstsq(rows / left[:, None], np.ones(len(prefill)))
    fit = Fit(step_s=step_s, decode_token_s=decode_token_s, context_token_s=context_token_s,
              prefill_token_s=prefill_token_s, prefill_pair_s=prefill_pair_s, decode_error=0.0, prefill_error=0.0)
    return fit.model_copy(update={
        "decode_error": _relative_error([fit.decode_step(p.batch, p.context) for p in decode],
                                        [p.seconds for p in decode]),
        "prefill_error": _relative_error([fit.prefill(p.prompt_tokens, p.prompts, max_num_batched_tokens)
                                          for p in prefill], [p.seconds for p in prefill])})


def read_profile(path: str | Path) -> Profile:
    """Raises ValueError with the file's name and what is wrong with it (missing, not JSON, not a profile)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the profile {path}: {e.strerror or e}") from None
    try:
        return Profile.model_validate_json(text)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(file)'}: {err['msg']}" for err in e.errors()[:5])
        raise ValueError(f"{path} is not a tandem profile (version {PROFILE_VERSION}): {problems}") from None


def write_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(profile.model_dump_json(indent=1) + "\n")
