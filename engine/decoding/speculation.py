"""Speculative decoding in the engine's step: which sequences propose how many tokens, and what that earned.

Each step the scheduler hands the Speculator its decoding sequences (one token to compute) that may speculate. The
Speculator asks the replica's proposer (engine/decoding/proposers.py: n-gram prompt lookup;
engine/decoding/suffix_proposer.py: suffix tries; engine/decoding/draft_proposer.py: a draft model) for up to
`max_tokens` tokens per sequence, keeping only proposals that pay by a cost model of the step measured on this replica:

- step time: t(T) = a + b * T for a decode step of T tokens (sequences plus proposals), fitted online by
  exponentially weighted least squares over the replica's recent decode steps, with a prior slope until steps of
  different sizes have been seen;
- value: the j-th proposal of a sequence yields a token only if the j - 1 before it are accepted too: alpha^j, with
  alpha the sequence's acceptance rate (its own recent proposals, shrunk toward the replica's rate).
A step of B sequences emits N = B + sum(values) tokens in t(T). The n-gram and suffix proposals are taken in
decreasing value while one more raises N / t, i.e. while its value exceeds b * N / t (and the proposer is not even
asked when the likeliest first proposal could not pay). A draft model's proposals cost a forward pass of the draft
per position, so its depth is chosen before it runs, with the draft's own step line (timed at engine start) and
the tokens it must first catch up on, spread over each sequence's expected remaining output. Last, a measured
guard: where, at about the current batch size, steps that verified proposals have cost more per emitted token than
steps that did not, no proposals are made. After 32 declined steps in a row one step verifies them anyway (a
probe), so that estimates follow a changing workload. At a large batch or a low acceptance the step thus runs as
without speculation. When the step itself changes (`compile: background`'s compiled step replacing the eager one:
the executor's step_version), the step line and the guard's averages start again.

Verification (engine/runner/) scores each sequence's proposals as a short chunk through the paged KV cache,
and the scheduler keeps the accepted ones. Which sequences never speculate: those with structured output (the
grammar would have to follow the proposals), those whose request set speculative_tokens=0, and any whose remaining
max_tokens or context leaves no room. Greedy and sampled outputs are identical to decoding without speculation
(engine/decoding/rejection_sampler.py: every emitted token is the target's own draw for its step), so the cost model may
change k freely.

Plain Python: no torch. The scheduler (engine thread) is the only caller.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from tandem.engine.decoding.proposers import NgramProposer, Proposer
from tandem.engine.decoding.suffix_proposer import SuffixProposer
from tandem.engine.engine_config import SpeculativeConfig
from tandem.engine.request import RequestStatus, Sequence as Seq
from tandem.engine.sampling_params import MAX_SPECULATIVE_TOKENS

ACCEPTANCE_BUCKETS = tuple(range(MAX_SPECULATIVE_TOKENS + 1))  # accepted proposals per verified step


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The n-gram or suffix proposer; a draft model is built by the engine (it needs the target's weights)."""
    if config.proposer == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.proposer == "suffix":
        return SuffixProposer(cached_requests=config.suffix_cached_requests)
    raise ValueError("the draft proposer is built from the engine's model (engine/decoding/draft_proposer.py)")


@dataclass(frozen=True)
class SpeculationStats:
    """Counters since the replica started, for its proposer: tokens proposed and accepted, verified steps by the
    number of proposals accepted (index = accepted count, 0..MAX_SPECULATIVE_TOKENS), and decode steps in which the
    cost model kept no proposal although the proposer had some."""

    proposer: str = ""
    proposed: int = 0
    accepted: int = 0
    acceptance_counts: tuple[int, ...] = ()
    declined_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class _Average:
    """An exponentially weighted mean (weight DECAY per observation) and how many observations it has seen."""

    DECAY = 0.9
    mean: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.mean = value if not self.count else self.DECAY * self.mean + (1 - self.DECAY) * value
        self.count += 1


class StepCost:
    """t(T) = a + b * T over decode steps, weighted least squares with exponential forgetting. Until the steps
    seen span different sizes, the slope is the prior share of a step per token (PRIOR_SLOPE of the mean time)."""

    DECAY = 0.97  # per observed step: about the last 30 steps count
    PRIOR_SLOPE = 0.05

    def __init__(self) -> None:
        self._w = self._t = self._x = self._xx = self._xt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        self._w = self._w * d + 1
        self._x = self._x * d + tokens
        self._t = self._t * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xt = self._xt * d + tokens * seconds

    @property
    def known(self) -> bool:
        return self._w > 0

    def line(self) -> tuple[float, float]:
        """(a, b): seconds per step and per token. (0, 0) before any observation."""
        if not self._w:
            return 0.0, 0.0
        mean_x, mean_t = self._x / self._w, self._t / self._w
        var = self._xx / self._w - mean_x * mean_x
        prior = self.PRIOR_SLOPE * mean_t
        if var < 0.25:  # all steps about the same size: the slope is not identified
            slope = prior
        else:
            # Shrink toward the prior in proportion to how little spread there is.
            slope = ((self._xt / self._w - mean_x * mean_t) + prior) / (var + 1.0)
        # A step never gets cheaper with more tokens, and a token never costs more than twice the mean token (an
        # outlier step, a pause, must not make every proposal look ruinous).
        slope = min(max(slope, 1e-3 * mean_t), 2 * mean_t / max(mean_x, 1.0))
        return max(mean_t - slope * mean_x, 0.0), slope


@dataclass
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0


@dataclass
class Speculator:
    """The replica's proposer, its sequences' acceptance and its step cost model. proposer: an instance to use
    instead of the config's (tests)."""

    config: SpeculativeConfig
    proposer: Proposer | None = None
    cost: StepCost = field(default_factory=StepCost)

    PRIOR_WEIGHT = 2.0  # a new sequence's acceptance counts the replica's rate as this many trials
    DECAY = 0.9  # a sequence's own history, per verified step
    PROBE_EVERY = 32  # declined steps in a row before one step verifies the proposals anyway
    LOSING_AFTER = 8  # steps with and without proposals measured at a batch size before _losing may say so

    def __post_init__(self) -> None:
        if self.proposer is None:
            self.proposer = make_proposer(self.config)
        self._seqs: dict[str, _Acceptance] = {}
        self._started: set[str] = set()
        self._replica = _Acceptance(1.0, 2.0)  # prior: half the proposals accepted
        self._counts = [0] * len(ACCEPTANCE_BUCKETS)
        self.proposed = self.accepted = self.declined_steps = 0
        self._declined_run = 0
        self._proposal_seconds = 0.0  # a draft model's forward passes since the last timed step
        # Seconds per emitted token of decode steps, by batch size (its bit length), [without, with] proposals.
        self._per_token: dict[int, list[_Average]] = {}
        self._output_length = _Average()  # tokens the replica's finished sequences generated
        self._step_version = 0  # the executor's step_version the step costs were timed on

    def limit(self, seq: Seq, max_model_len: int) -> int:
        """How many tokens seq may propose this step: 0 when it must not speculate."""
        p = seq.params
        if p.structured is not None or p.speculative_tokens == 0:
            return 0
        k = self.config.max_tokens if p.speculative_tokens is None else min(p.speculative_tokens,
                                                                            self.config.max_tokens)
        # k proposals emit up to k + 1 tokens: within max_tokens and the context.
        return max(0, min(k, p.max_tokens - len(seq.output_token_ids) - 1, max_model_len - seq.num_tokens - 1))

    def propose(self, running: Sequence[Seq], max_model_len: int) -> dict[str, tuple[int, ...]]:
        """This step's proposals for the running sequences that decode and may speculate (seq id -> tokens)."""
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        limits = [(s, k) for s in decoding if (k := self.limit(s, max_model_len)) > 0]
        return self.plan(limits, len(decoding)) if limits else {}

    def plan(self, seqs: Sequence[tuple[Seq, int]], num_decoding: int) -> dict[str, tuple[int, ...]]:
        """Proposals for this step: seq id -> tokens, for (sequence, limit) pairs; num_decoding: the step's
        decoding sequences (speculating or not), the batch the cost model prices."""
        if hasattr(self.proposer, "propose_batch"):
            return self._plan_draft(seqs, num_decoding)
        probing = self.config.adaptive and self._probing()
        if self.config.adaptive and not probing and (self._losing(num_decoding) or
                                                     not self._may_pay(seqs, num_decoding)):
            self._declined(True)  # not even the likeliest first proposal would pay: do not ask for any
            return {}
        proposals = {}
        for seq, k in seqs:
            if seq.seq_id not in self._started:
                self._started.add(seq.seq_id)
                if isinstance(self.proposer, SuffixProposer):
                    self.proposer.start(seq.seq_id, seq.cache_salt)
            tokens = self.proposer.propose(seq.seq_id, seq.token_ids, k)
            if tokens:
                proposals[seq.seq_id] = tuple(tokens[:k])
        if not proposals or not self.config.adaptive or probing:
            return proposals
        kept = self._worth_it(proposals, num_decoding)
        self._declined(not kept)
        return kept

    def _may_pay(self, seqs: Sequence[tuple[Seq, int]], num_decoding: int) -> bool:
        """Whether the best proposal this step could bring (the highest acceptance, first position) would raise
        tokens per second; True while the step cost is unknown."""
        if not self.cost.known:
            return True
        a, b = self.cost.line()
        best = max(self.acceptance(seq.seq_id) for seq, _ in seqs)
        return best * (a + b * num_decoding) > b * num_decoding

    def _plan_draft(self, seqs: Sequence[tuple[Seq, int]], num_decoding: int) -> dict[str, tuple[int, ...]]:
        """A draft model's proposals cost its forward passes, one per proposed position: the depth is priced
        before they run (_draft_depth), and their time is kept out of the target's step cost."""
        # The cost model prices a draft's depth before it runs, with the acceptance last measured (no probing:
        # a draft that sat out steps first recomputes every token it missed); only where measured steps show it
        # losing does it wait for a probe.
        top = max(k for _, k in seqs)
        if not self.config.adaptive:
            depth = top
        elif self._losing(num_decoding):
            depth = top if self._probing() else 0
        else:
            depth = self._draft_depth(seqs, num_decoding)
        self._declined(depth == 0)
        if depth == 0:
            return {}
        start = time.perf_counter()
        proposals = self.proposer.propose_batch([(seq, min(k, depth)) for seq, k in seqs])
        self._proposal_seconds += time.perf_counter() - start
        return {seq_id: tuple(tokens) for seq_id, tokens in proposals.items() if tokens}

    def _draft_depth(self, seqs: Sequence[tuple[Seq, int]], num_decoding: int) -> int:
        """The number of draft positions that maximizes the step's expected tokens per second: the target's step
        line, plus one draft pass per position (the draft's own line, measured), against alpha ** j per
        proposal."""
        top = max(k for _, k in seqs)
        if not self.cost.known:  # the first decode step runs without: it prices the target's step
            return 0
        if not self.proposer.cost.known:  # a draft not timed at start (DraftProposer.warm_up): try, to learn
            return top
        a, b = self.cost.line()
        da, db = self.proposer.cost.line()
        alphas = [(self.acceptance(seq.seq_id), k) for seq, k in seqs]
        # The tokens the draft lacks (a new sequence's whole prompt) are computed once, then serve the sequence's
        # remaining steps: each step bears that cost times its share of the expected remaining tokens.
        catch_up = [(db * max(0, self.proposer.missing(seq) - 1), self._remaining(seq)) for seq, _ in seqs]
        best, best_rate = 0, num_decoding / (a + b * num_decoding)
        for depth in range(1, top + 1):
            used = [min(k, depth) for _, k in alphas]
            gains = [1 + sum(alpha ** j for j in range(1, u + 1)) for (alpha, _), u in zip(alphas, used)]
            tokens = num_decoding - len(seqs) + sum(gains)
            seconds = a + b * (num_decoding + sum(used)) + depth * (da + db * len(seqs)) + \
                sum(cost * gain / remaining for (cost, remaining), gain in zip(catch_up, gains))
            if tokens / seconds > best_rate:
                best, best_rate = depth, tokens / seconds
        return best

    def _remaining(self, seq: Seq) -> float:
        """The tokens seq is expected to generate still: up to its max_tokens, and no more than the replica's
        recent outputs were long (once some have finished), at least one."""
        left = seq.params.max_tokens - len(seq.output_token_ids)
        if self._output_length.count:
            left = min(left, self._output_length.mean - len(seq.output_token_ids))
        return max(1.0, left)

    def _probing(self) -> bool:
        """After PROBE_EVERY steps in a row without proposals worth verifying, one step verifies them anyway, so
        that the acceptance estimates follow a workload that changed (n-gram and suffix proposers)."""
        if self._declined_run < self.PROBE_EVERY:
            return False
        self._declined_run = 0
        return True

    def _declined(self, declined: bool) -> None:
        if declined:
            self.declined_steps += 1
            self._declined_run += 1
        else:
            self._declined_run = 0

    def acceptance(self, seq_id: str) -> float:
        """The sequence's estimated chance that one proposal is accepted."""
        own, rep = self._seqs.get(seq_id, _Acceptance()), self._replica
        prior = rep.accepted / rep.trials if rep.trials else 0.5
        return (own.accepted + self.PRIOR_WEIGHT * prior) / (own.trials + self.PRIOR_WEIGHT)

    def _worth_it(self, proposals: dict[str, tuple[int, ...]], num_decoding: int) -> dict[str, tuple[int, ...]]:
        a, b = self.cost.line()
        if not self.cost.known:  # no decode step timed yet: try them, to learn
            return proposals
        items = []  # (value, seq id, j): the j-th proposal of a sequence is worth alpha ** j tokens
        for seq_id, tokens in proposals.items():
            alpha = self.acceptance(seq_id)
            items.extend((alpha ** j, seq_id, j) for j in range(1, len(tokens) + 1))
        items.sort(reverse=True)
        emitted, seconds = float(num_decoding), a + b * num_decoding
        keep: dict[str, int] = {}
        for value, seq_id, j in items:
            if value * seconds <= b * emitted:  # one more token of work would lower tokens per second
                break
            emitted += value
            seconds += b
            keep[seq_id] = max(keep.get(seq_id, 0), j)
        return {seq_id: proposals[seq_id][:j] for seq_id, j in keep.items()}

    def verified(self, seq_id: str, num_proposed: int, num_accepted: int) -> None:
        """Records one verification: num_accepted of num_proposed proposals were accepted."""
        trials = num_accepted + (num_accepted < num_proposed)  # positions tested: the accepted, then the reject
        own = self._seqs.setdefault(seq_id, _Acceptance())
        own.accepted = own.accepted * self.DECAY + num_accepted
        own.trials = own.trials * self.DECAY + trials
        rep = self._replica
        rep.accepted = rep.accepted * 0.99 + num_accepted
        rep.trials = rep.trials * 0.99 + trials
        self.proposed += num_proposed
        self.accepted += num_accepted
        self._counts[num_accepted] += 1

    def step_timed(self, num_seqs: int, num_tokens: int, emitted: int, seconds: float, speculated: bool) -> None:
        """A decode step (no prefill chunk) of num_seqs sequences, num_tokens tokens computed and `emitted` tokens
        out took seconds, end to end. The step line leaves a draft model's passes out (they are the draft's own
        line); the per-token check (_losing) counts everything."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if emitted > 0:
            per_token = self._per_token.setdefault(num_seqs.bit_length(), [_Average(), _Average()])
            per_token[speculated].observe(seconds / emitted)
        target, self._proposal_seconds = seconds - self._proposal_seconds, 0.0
        if target > 0:
            self.cost.observe(num_tokens, target)

    def step_is(self, version: int) -> None:
        """The executor's step_version now: when it changed (a compiled step replaced the eager one), the step line
        and the per-token averages, which timed the other step, start again."""
        if version != self._step_version:
            self._step_version = version
            self.cost = StepCost()
            self._per_token.clear()

    def _losing(self, num_seqs: int) -> bool:
        """Whether, at about this many sequences, steps that verified proposals have cost more per emitted token
        than steps that did not (each measured over recent steps, LOSING_AFTER of each at least): the model of
        the step is then wrong for this batch, and proposals wait for a probe to show otherwise."""
        plain, speculated = self._per_token.get(num_seqs.bit_length(), (None, None))
        return plain is not None and min(plain.count, speculated.count) >= self.LOSING_AFTER and \
            speculated.mean > plain.mean

    def forget(self, seq: Seq) -> None:
        """seq ended: its state goes; a finished sequence's output joins the suffix proposer's shared cache."""
        if seq.status is not RequestStatus.FINISHED_ABORTED:
            self._output_length.observe(len(seq.output_token_ids))
        self._seqs.pop(seq.seq_id, None)
        self._started.discard(seq.seq_id)
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.forget(seq.seq_id, seq.output_token_ids if seq.status.finished else ())
        else:
            self.proposer.forget(seq.seq_id)

    def stats(self) -> SpeculationStats:
        return SpeculationStats(self.proposer.name, self.proposed, self.accepted, tuple(self._counts),
                                self.declined_steps)
