"""Speculative decoding in the engine's step: which sequences propose how many tokens, and what that earned.

Each step the scheduler hands the Speculator its decoding sequences (one token to compute) that may speculate. The
Speculator asks the replica's proposer (engine/decoding/proposers.py: n-gram prompt lookup;
engine/decoding/suffix_proposer.py: suffix tries; engine/decoding/draft_proposer.py: a draft model) for up to
`max_tokens` tokens per sequence. A step that also computes a prompt chunk verifies none (adaptive speculation:
they would push the chunk's tokens out of the step's budget; see propose). Whether any other step verifies
proposals is measured where it can be: at about the current batch size (its bit length), the replica keeps the
mean time per emitted token of its recent decode steps with proposals and of those without, and each step does what
has cost less, but for one step of the other after 16 in a row (a probe), so that both measures follow a changing
workload. At a batch size where these are not yet measured, it verifies none if the step lines below guess, from
what verifying steps at other sizes proposed and emitted, that verifying would cost more (probed the same way, so
that the measure takes over); else it verifies none for 8 steps, then all proposals for 8. (A guessed gain is not
taken on trust: were it wrong, the measure would take over only after 8 probes.) (Step times on a 2-core
machine vary by a tenth from step to step and by more between runs; a model of the step fitted to them misjudged
the fixed cost of a verifying step by several times, while the two measured means told the cases apart.)

Which proposals a verifying step keeps follows a cost model of the step measured on this replica:
- step time: a decode step of S sequences without proposals takes t0(S) = a + b * S; one that also verifies P
  proposals takes t0(S) + c + d * P: c, the fixed cost of a verifying step (it scores short chunks: its
  attention leaves the one-token paged kernel, though the step stays compiled), d, the cost of one proposal. Both
  lines are fitted online by exponentially weighted least squares, the first over the replica's recent decode
  steps without proposals, the second over the time its recent verifying steps took beyond the first line, each
  with a prior slope until steps of different sizes have been seen;
- value: the j-th proposal of a sequence yields a token only if the j - 1 before it are accepted too: alpha^j, with
  alpha the sequence's acceptance rate (its own recent proposals, shrunk toward the replica's rate).
A step of S sequences that verifies the m proposals of highest value emits N = S + sum(values) tokens: the n-gram
and suffix proposals kept are the m >= 1 that maximize N / t. A draft model's proposals cost a forward pass of the
draft per position, so its depth is chosen before it runs, with the draft's own step line (timed at engine start)
and the tokens it must first catch up on, spread over each sequence's expected remaining output. At a large batch
or a low acceptance the step thus runs as without speculation. When the step itself changes (`compile:
background`'s compiled step replacing the eager one: the executor's step_version), the step lines and the
measured means start again.

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
        # A proposal follows a matched suffix (at most `match` tokens) for at most max_tokens: deeper windows would
        # never be read, and each costs the trie a node per token indexed.
        match = SuffixProposer.MATCH
        return SuffixProposer(depth=match + config.max_tokens, match=match,
                              cached_requests=config.suffix_cached_requests)
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
    """t(x) = a + b * x over steps of size x, weighted least squares with exponential forgetting. Until the steps
    seen span different sizes, the slope is a prior: PRIOR_SLOPE of the mean time per unit of size, or, with
    `share`, that share of the mean time spread over the mean size (the rest is the intercept)."""

    DECAY = 0.97  # per observed step: about the last 30 steps count
    PRIOR_SLOPE = 0.05

    def __init__(self, share: float | None = None) -> None:
        self._share = share
        self._w = self._t = self._x = self._xx = self._xt = 0.0

    def observe(self, size: float, seconds: float) -> None:
        d = self.DECAY
        self._w = self._w * d + 1
        self._x = self._x * d + size
        self._t = self._t * d + seconds
        self._xx = self._xx * d + size * size
        self._xt = self._xt * d + size * seconds

    @property
    def known(self) -> bool:
        return self._w > 0

    def line(self) -> tuple[float, float]:
        """(a, b): seconds per step and per unit of size. (0, 0) before any observation."""
        if not self._w:
            return 0.0, 0.0
        mean_x, mean_t = self._x / self._w, self._t / self._w
        var = self._xx / self._w - mean_x * mean_x
        if self._share is None:
            prior = self.PRIOR_SLOPE * mean_t
        else:
            prior = self._share * mean_t / max(mean_x, 1.0)
        if var < 0.25:  # all steps about the same size: the slope is not identified
            slope = prior
        else:
            # Shrink toward the prior in proportion to how little spread there is.
            slope = ((self._xt / self._w - mean_x * mean_t) + prior) / (var + 1.0)
        # A step never gets cheaper with size, and a unit never costs more than twice the mean unit (an outlier
        # step, a pause, must not make every proposal look ruinous).
        slope = min(max(slope, 1e-3 * mean_t), 2 * mean_t / max(mean_x, 1.0))
        return max(mean_t - slope * mean_x, 0.0), slope

    def at(self, size: float) -> float:
        """The predicted seconds of a step of this size."""
        a, b = self.line()
        return a + b * size


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
    cost: StepCost = field(default_factory=StepCost)  # decode steps without proposals: sequences -> seconds
    # A verifying step's time beyond `cost`: proposals -> seconds. Until the number of proposals varies, half of
    # it is taken as fixed (the verifying step's own cost) and half as per proposal.
    verify: StepCost = field(default_factory=lambda: StepCost(share=0.5))

    PRIOR_WEIGHT = 2.0  # a new sequence's acceptance counts the replica's rate as this many trials
    DECAY = 0.9  # a sequence's own history, per verified step
    PROBE_EVERY = 16  # steps in a row that verified proposals (or none) before one step of the other (a probe)
    PROBE_MOST = 64  # ... which doubles, up to this, each time a probe leaves the choice at its batch size as it was
    PAUSE = 2.0  # a step slower per emitted token than this many times its average counts as this many (a pause)
    MEASURED_AFTER = 8  # steps with and without proposals measured at a batch size before _mode compares them

    def __post_init__(self) -> None:
        if self.proposer is None:
            self.proposer = make_proposer(self.config)
        self._seqs: dict[str, _Acceptance] = {}
        self._started: set[str] = set()
        self._replica = _Acceptance(1.0, 2.0)  # prior: half the proposals accepted
        self._counts = [0] * len(ACCEPTANCE_BUCKETS)
        self.proposed = self.accepted = self.declined_steps = 0
        self._run, self._run_declined = 0, False  # steps in a row that verified no proposal (or some)
        self._probe_every: dict[int, int] = {}  # by batch size (its bit length): the run a probe waits for
        self._probed: tuple[int, bool] | None = None  # the last probe's batch size and the choice it went against
        self._proposal_seconds = 0.0  # a draft model's forward passes since the last timed step
        # Seconds per emitted token of decode steps, by batch size (its bit length), [without, with] proposals.
        self._per_token: dict[int, list[_Average]] = {}
        self._output_length = _Average()  # tokens the replica's finished sequences generated
        # Verifying steps' proposals and emitted tokens per sequence (_predicted).
        self._proposed_per_seq, self._yield = _Average(), _Average()
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

    def propose(self, running: Sequence[Seq], max_model_len: int,
                prefills: bool = False) -> dict[str, tuple[int, ...]]:
        """This step's proposals for the running sequences that decode and may speculate (seq id -> tokens).
        prefills: the step also computes a prompt chunk. Adaptive speculation then proposes nothing: the proposals
        would take the chunk's place in the step's token budget and its prompt would need more steps (measured at
        16 sequences on a 2-core CPU: such steps' proposals cost 18 ms per accepted token, against 7 ms a token of a
        plain decode step), and these steps, untimed, could not tell whether they paid."""
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        limits = [(s, k) for s in decoding if (k := self.limit(s, max_model_len)) > 0]
        if not limits:
            return {}
        if prefills and self.config.adaptive:
            self.declined_steps += 1
            return {}
        return self.plan(limits, len(decoding))

    def plan(self, seqs: Sequence[tuple[Seq, int]], num_decoding: int) -> dict[str, tuple[int, ...]]:
        """Proposals for this step: seq id -> tokens, for (sequence, limit) pairs; num_decoding: the step's
        decoding sequences (speculating or not), the batch the cost model prices."""
        mode = self._mode(num_decoding) if self.config.adaptive else "all"
        if hasattr(self.proposer, "propose_batch"):
            return self._plan_draft(seqs, num_decoding, mode)
        if mode == "off":
            self._declined(True)
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
        if mode == "all" or not proposals:
            self._declined(not proposals, counted=False)  # verifies what the proposer had: nothing dropped
            return proposals
        kept = self._worth_it(proposals, num_decoding)
        self._declined(not kept)
        return kept

    def _mode(self, num_seqs: int) -> str:
        """How this step speculates ("trim": the proposals that pay by the step lines, all of them until both lines
        are known; "off": none), at about this many sequences: once MEASURED_AFTER steps with and as many without
        proposals have been timed there, whichever has cost less per emitted token; before, "off" where the step
        lines guess that verifying loses (_predicted), else "off" for MEASURED_AFTER steps (the plain line verifying
        steps are timed against), then "trim". Measured or guessed, one step of the other after PROBE_EVERY in a row
        (a probe), so that both measures follow the workload; a probe that leaves the choice as it was doubles the
        wait for the next one there (up to PROBE_MOST: a probe of a clear loss costs), one that changes it resets it."""
        bucket = num_seqs.bit_length()
        plain, speculated = self._per_token.get(bucket, (_Average(), _Average()))
        if speculated.count >= self.MEASURED_AFTER and plain.count >= self.MEASURED_AFTER:
            speculate = speculated.mean < plain.mean
        elif self._predicted(num_seqs) is False:
            speculate = False  # a guessed loss: off, probed (a guessed gain learns as below: a wrong one costs less)
        else:
            return "off" if plain.count < self.MEASURED_AFTER else "trim"
        wait = self._probe_every.get(bucket, self.PROBE_EVERY)
        if self._probed is not None and self._probed[0] == bucket:  # the last probe, timed: did it change the choice?
            wait = self._probe_every[bucket] = min(2 * wait, self.PROBE_MOST) if speculate == self._probed[1] \
                else self.PROBE_EVERY
        self._probed = None
        if self._run >= wait and self._run_declined != speculate:
            self._probed = bucket, speculate
            speculate = not speculate
        return "trim" if speculate else "off"

    def _predicted(self, num_seqs: int) -> bool | None:
        """Whether verifying steps of num_seqs sequences should cost less per emitted token than plain ones, by the
        step lines and what verifying steps elsewhere proposed and emitted per sequence; None until MEASURED_AFTER
        verifying steps have been timed (at any batch size). A batch size not yet measured starts on this guess."""
        if self._yield.count < self.MEASURED_AFTER or not (self.cost.known and self.verify.known):
            return None
        plain = self.cost.at(num_seqs)
        verifying = plain + self.verify.at(self._proposed_per_seq.mean * num_seqs)
        return verifying / self._yield.mean < plain

    def _best_count(self, values: Sequence[float], num_decoding: int) -> int:
        """How many of the proposals worth `values` tokens (largest first) a verifying step of num_decoding
        sequences should verify: at least one (measured steps chose to verify), then as many as raise its
        expected tokens per second by the step lines."""
        plain = max(self.cost.at(num_decoding), 1e-9)
        fixed, per_proposal = self.verify.line()
        best, best_rate, tokens = 0, 0.0, float(num_decoding)
        for count, value in enumerate(values, 1):
            tokens += value
            if tokens / (plain + fixed + per_proposal * count) > best_rate:
                best, best_rate = count, tokens / (plain + fixed + per_proposal * count)
        return best

    def _plan_draft(self, seqs: Sequence[tuple[Seq, int]], num_decoding: int,
                    mode: str) -> dict[str, tuple[int, ...]]:
        """A draft model's proposals cost its forward passes, one per proposed position: the depth is priced
        before they run (_draft_depth), and their time is kept out of the target's step cost."""
        top = max(k for _, k in seqs)
        if mode == "trim":
            depth = self._draft_depth(seqs, num_decoding)
        else:
            depth = top if mode == "all" else 0
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
        if not self.proposer.cost.known or not self.verify.known:  # try, to learn what drafting costs
            return top
        plain = self.cost.at(num_decoding)
        fixed, per_proposal = self.verify.line()
        da, db = self.proposer.cost.line()
        alphas = [(self.acceptance(seq.seq_id), k) for seq, k in seqs]
        # The tokens the draft lacks (a new sequence's whole prompt) are computed once, then serve the sequence's
        # remaining steps: each step bears that cost times its share of the expected remaining tokens.
        catch_up = [(db * max(0, self.proposer.missing(seq) - 1), self._remaining(seq)) for seq, _ in seqs]
        best, best_rate = 0, num_decoding / plain
        for depth in range(1, top + 1):
            used = [min(k, depth) for _, k in alphas]
            gains = [1 + sum(alpha ** j for j in range(1, u + 1)) for (alpha, _), u in zip(alphas, used)]
            tokens = num_decoding - len(seqs) + sum(gains)
            seconds = plain + fixed + per_proposal * sum(used) + depth * (da + db * len(seqs)) + \
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

    def _declined(self, declined: bool, counted: bool = True) -> None:
        """A decode step verifies no proposal (declined) or some: the run of steps in a row alike, and (counted) the
        steps whose proposals the speculator chose not to verify."""
        self.declined_steps += declined and counted
        self._run = self._run + 1 if declined == self._run_declined else 1
        self._run_declined = declined

    def acceptance(self, seq_id: str) -> float:
        """The sequence's estimated chance that one proposal is accepted."""
        own, rep = self._seqs.get(seq_id, _Acceptance()), self._replica
        prior = rep.accepted / rep.trials if rep.trials else 0.5
        return (own.accepted + self.PRIOR_WEIGHT * prior) / (own.trials + self.PRIOR_WEIGHT)

    def _worth_it(self, proposals: dict[str, tuple[int, ...]], num_decoding: int) -> dict[str, tuple[int, ...]]:
        """The proposals a verifying step keeps: the j-th of a sequence is worth alpha ** j tokens; those of highest
        value, as many as pay (_best_count). All of them until both step lines have been fitted."""
        if not (self.cost.known and self.verify.known):
            return proposals
        items = sorted(((self.acceptance(seq_id) ** j, seq_id, j) for seq_id, tokens in proposals.items()
                        for j in range(1, len(tokens) + 1)), reverse=True)
        keep: dict[str, int] = {}
        for _, seq_id, j in items[:self._best_count([value for value, _, _ in items], num_decoding)]:
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
        """A decode step (no prefill chunk) of num_seqs sequences, num_tokens tokens computed (the sequences and
        their proposals) and `emitted` tokens out took seconds, end to end. The step lines leave a draft model's
        passes out (they are the draft's own line); the per-token measures (_mode) count everything."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if emitted > 0:
            average = self._per_token.setdefault(num_seqs.bit_length(), [_Average(), _Average()])[speculated]
            # A pause (the collector, the OS: 30x a step's time per token, seen at 16 sequences) is not what the step
            # costs: at most PAUSE times the average, or one such step would turn speculation on or off for dozens.
            average.observe(min(seconds / emitted, self.PAUSE * average.mean) if average.count else seconds / emitted)
            if speculated:
                self._proposed_per_seq.observe((num_tokens - num_seqs) / num_seqs)
                self._yield.observe(emitted / num_seqs)
        target, self._proposal_seconds = seconds - self._proposal_seconds, 0.0
        if target <= 0:
            return
        if num_tokens == num_seqs:
            self.cost.observe(num_seqs, target)
        elif self.cost.known:  # what the proposals added to the step without them
            self.verify.observe(num_tokens - num_seqs, max(target - self.cost.at(num_seqs), 0.0))

    def step_is(self, version: int) -> None:
        """The executor's step_version now: when it changed (a compiled step replaced the eager one), the step lines
        and the per-token averages, which timed the other step, start again."""
        if version != self._step_version:
            self._step_version = version
            self.cost, self.verify = StepCost(), StepCost(share=0.5)
            self._per_token.clear()
            self._probe_every.clear()

    def timed_steps(self) -> dict[str, tuple[int, int]]:
        """Decode steps timed since the step last changed, by batch size ("16-31" sequences): (without proposals,
        with them), what _mode compared there."""
        return {f"{1 << (bucket - 1)}-{(1 << bucket) - 1}": (plain.count, speculated.count)
                for bucket, (plain, speculated) in sorted(self._per_token.items())}

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
