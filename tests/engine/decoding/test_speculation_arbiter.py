"""The speculator's cost model and arbiter (engine/decoding/speculation.py) on timed steps fed to it, without the
model: the step lines, which proposals a verifying step keeps, whether a step verifies at each batch size (learned,
guessed, probed), the draft's depth, and a new step starting the costs again."""

from __future__ import annotations

import pytest

from tandem.engine.decoding.speculation import Speculator, StepCost
from tandem.engine.engine_config import SpeculativeConfig
from tandem.engine.request import RequestStatus
from tandem.engine.sampling_params import SamplingParams


def _cost(points: list[tuple[int, float]]) -> StepCost:
    cost = StepCost()
    for tokens, seconds in points:
        cost.observe(tokens, seconds)
    return cost


def test_step_cost_line_is_fitted_from_steps_of_different_sizes():
    a, b = _cost([(t, 0.02 + 0.001 * t) for t in (1, 3, 5, 2, 4, 1, 5) * 5]).line()
    assert a == pytest.approx(0.02, rel=0.1) and b == pytest.approx(0.001, rel=0.15)
    a, b = _cost([(4, 0.03)] * 10).line()  # one size only: the prior slope
    assert b == pytest.approx(StepCost.PRIOR_SLOPE * 0.03) and a + 4 * b == pytest.approx(0.03)


def test_the_cost_model_keeps_proposals_only_where_they_pay():
    speculator = Speculator(SpeculativeConfig(max_tokens=4))
    proposals = {"a": (1, 2, 3, 4), "b": (5, 6, 7, 8)}
    speculator.cost = _cost([(s, 0.02 + 0.002 * s) for s in (1, 2, 5, 9) * 5])  # a sequence: 1/10 of a step
    speculator.verify = _cost([(p, 0.002 * p) for p in (1, 4, 8) * 5])  # a proposal costs what a sequence does
    for _ in range(10):
        speculator.verified("a", 4, 4)  # "a" is always accepted, "b" never
        speculator.verified("b", 4, 0)
    assert speculator._worth_it(proposals, num_decoding=2) == {"a": (1, 2, 3, 4)}
    # Compute-bound: a proposal costs what a sequence does. A verifying step keeps one (the measured means chose
    # to verify), the likeliest.
    speculator.cost = _cost([(s, 0.001 * s) for s in (16, 32, 48, 64) * 5])
    speculator.verify = _cost([(p, 0.001 * p) for p in (1, 16, 64) * 5])
    assert speculator._worth_it(proposals, num_decoding=16) == {"a": (1,)}


def test_a_verifying_steps_fixed_cost_is_fitted_apart_and_paid_once():
    """A step with proposals leaves the one-token decode path: it costs a fixed amount more, then a little per
    proposal. The two are told apart from the steps' times; the fixed cost, paid once, makes every likely proposal
    of the step worth keeping, and the unlikely ones are still dropped."""
    speculator = Speculator(SpeculativeConfig(max_tokens=4))
    for p in (16, 40, 64, 24, 48) * 6:
        speculator.step_timed(16, 16, 16, 0.100, speculated=False)
        speculator.step_timed(16, 16 + p, 16 + p // 2, 0.100 + 0.030 + 0.001 * p, speculated=True)
    assert speculator.cost.at(16) == pytest.approx(0.100)
    fixed, per_proposal = speculator.verify.line()
    assert fixed == pytest.approx(0.030, rel=0.05) and per_proposal == pytest.approx(0.001, rel=0.05)
    for i in range(16):
        for _ in range(10):
            speculator.verified(f"s{i}", 4, 4 if i < 8 else 0)  # half always accepted, half never
    every = {f"s{i}": (1, 2, 3, 4) for i in range(16)}
    assert speculator._worth_it(every, num_decoding=16) == {f"s{i}": (1, 2, 3, 4) for i in range(8)}


def test_whether_a_step_verifies_is_measured_at_each_batch_size():
    """A batch size new to the replica declines for MEASURED_AFTER steps, then verifies for as many; then each step
    does what cost less per emitted token there, with one step of the other after PROBE_EVERY in a row, and twice
    as many after a probe that left the choice as it was."""
    speculator = Speculator(SpeculativeConfig(max_tokens=4))
    modes = []
    for _ in range(2 * Speculator.MEASURED_AFTER):
        modes.append(speculator._mode(16))
        speculated = modes[-1] != "off"
        speculator._declined(not speculated)
        # Verifying steps: 18 tokens in 80 ms (4.4 ms a token), against 16 in 50 ms (3.1 ms) without.
        speculator.step_timed(16, 20 if speculated else 16, 18 if speculated else 16, 0.080 if speculated else 0.050,
                              speculated)
    assert modes == ["off"] * Speculator.MEASURED_AFTER + ["trim"] * Speculator.MEASURED_AFTER
    assert speculator.timed_steps() == {"16-31": (Speculator.MEASURED_AFTER, Speculator.MEASURED_AFTER)}
    later = []
    for _ in range(8 * Speculator.PROBE_EVERY):
        later.append(speculator._mode(16))
        speculator._declined(later[-1] == "off")
    probes = [i for i, mode in enumerate(later) if mode == "trim"]
    first = Speculator.PROBE_EVERY
    assert probes == [first, first + 1 + 2 * first, first + 2 + 6 * first]  # waits 16, 32, 64, ...
    assert Speculator.PROBE_MOST == 4 * first
    # One sequence: not measured there; the step lines fitted at 16 (a step 50 ms, verifying 4 proposals 30 ms more
    # for 2 more tokens) guess that verifying loses there too.
    assert speculator._predicted(1) is False and speculator._mode(1) == "off"
    for _ in range(4 * Speculator.MEASURED_AFTER):  # verifying steps that pay: 3 tokens in 40 ms against 1 in 30
        speculator.step_timed(1, 4, 3, 0.040, speculated=True)
        speculator.step_timed(1, 1, 1, 0.030, speculated=False)
    assert speculator._mode(1) == "trim" and speculator._mode(16) == "off"


def test_a_batch_size_not_yet_measured_starts_on_the_step_lines_guess():
    """Verifying steps measured at 16 sequences (1 ms a proposal beyond a step of 20 ms + 1 ms a sequence, about 2.8
    proposals and 1.5 tokens emitted a sequence): by those lines, verifying pays at one sequence (about 25 ms for 1.5
    tokens against 20 ms for 1) and loses at 8 (about 52 ms for 12 against 28 ms for 8). The guessed loss turns it
    off at 8, probed like a measure, and the measure takes over once it has MEASURED_AFTER steps of each; the
    guessed gain is learned as at a new size (plain steps, then verifying ones)."""
    speculator = Speculator(SpeculativeConfig(max_tokens=4))
    assert speculator._predicted(1) is None  # no verifying step timed yet: nothing to guess from
    for size in (16, 12, 16, 10) * 4:  # plain steps of sizes that fit the line, then verifying ones
        speculator.step_timed(size, size, size, 0.020 + 0.001 * size, speculated=False)
    for proposals in (48, 40, 48, 44) * 3:
        speculator.step_timed(16, 16 + proposals, 24, 0.036 + 0.001 * proposals, speculated=True)
    assert speculator._predicted(1) is True and speculator._predicted(8) is False
    assert speculator._mode(8) == "off"
    for _ in range(Speculator.MEASURED_AFTER):
        assert speculator._mode(1) == "off"
        speculator.step_timed(1, 1, 1, 0.021, speculated=False)
    assert speculator._mode(1) == "trim"
    for _ in range(Speculator.PROBE_EVERY):
        speculator._declined(True)
    assert speculator._mode(8) == "trim"  # a probe of the guess
    for _ in range(Speculator.MEASURED_AFTER):  # at 8, verifying steps measured to pay after all
        speculator.step_timed(8, 32, 16, 0.030, speculated=True)
        speculator.step_timed(8, 8, 8, 0.026, speculated=False)
    speculator._declined(False)
    assert speculator._mode(8) == "trim"


def test_the_draft_depth_follows_the_batch_cost():
    """One draft pass per proposed position: deep at batch 1 with a cheap draft and a high acceptance, none at a
    batch where the target's extra tokens and the draft's passes cost more than they bring."""
    class TimedDraft:
        name = "draft"

        def __init__(self, cost):
            self.cost, self.lacking = cost, 1

        def missing(self, seq):
            return self.lacking

        def propose_batch(self, requests):
            return {seq.seq_id: [1] * k for seq, k in requests}

        def forget(self, seq_id):
            pass

    seqs = [(_FakeSeq(f"s{i}"), 4) for i in range(16)]
    speculator = Speculator(SpeculativeConfig(proposer="draft", max_tokens=4),
                            TimedDraft(_cost([(n, 0.008 + 0.0016 * n) for n in (1, 16) * 5])))
    speculator.cost = _cost([(n, 0.029 + 0.0015 * n) for n in (1, 2, 5) * 5])  # the float32 target at batch 1
    speculator.verify = _cost([(p, 0.0015 * p) for p in (1, 4, 16) * 5])
    for seq, _ in seqs:
        for _ in range(5):
            speculator.verified(seq.seq_id, 4, 4)
    assert speculator._draft_depth(seqs[:1], 1) == 4
    # A prompt of 400 tokens the draft has not seen: worth computing for a long output, not for a short one.
    speculator.proposer.lacking = 400
    assert speculator._draft_depth(seqs[:1], 1) == 4
    for _ in range(5):
        finished = _FakeSeq("done")
        finished.output_token_ids = [1] * 6
        speculator.forget(finished)  # the replica's outputs have been 6 tokens long
    assert speculator._draft_depth(seqs[:1], 1) == 0
    speculator.proposer.lacking = 1
    speculator.cost = _cost([(n, 0.010 + 0.0025 * n) for n in (16, 20, 40) * 5])  # at 16 sequences
    speculator.verify = _cost([(p, 0.0025 * p) for p in (1, 16, 64) * 5])
    assert speculator._draft_depth(seqs, 16) == 0


class _FakeSeq:
    def __init__(self, seq_id: str):
        self.seq_id = seq_id
        self.params = SamplingParams(max_tokens=100)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.FINISHED_STOPPED


def test_measured_steps_that_lose_turn_proposals_off_at_that_batch_size():
    """Whatever the step line says, when steps that verified proposals cost more per emitted token than steps
    that did not (at about the same batch size), the speculator stops proposing there, but for a probe now and
    then; other batch sizes are not affected."""
    class Always:
        name = "always"

        def propose(self, seq_id, token_ids, k):
            return [1] * k

        def forget(self, seq_id):
            pass

    speculator = Speculator(SpeculativeConfig(max_tokens=2), Always())
    seqs = [(_FakeSeq(f"s{i}"), 2) for i in range(16)]
    for seq, _ in seqs:
        seq.token_ids, seq.cache_salt = [1, 2, 3], None
    for _ in range(10):
        speculator.verified("s0", 2, 2)
        speculator.step_timed(16, 16, 16, 0.050, speculated=False)
        speculator.step_timed(16, 20, 18, 0.080, speculated=True)  # 4.4 ms per token against 3.1
    speculator.cost = _cost([(n, 0.001 + 0.0001 * n) for n in (1, 16, 32) * 5])  # lines that say "cheap"
    speculator.verify = _cost([(p, 0.0001 * p) for p in (1, 16, 32) * 5])
    assert speculator._mode(16) == "off"
    planned = [speculator.plan(seqs, 16) for _ in range(Speculator.PROBE_EVERY + 1)]
    assert planned[:-1] == [{}] * Speculator.PROBE_EVERY and planned[-1]  # declined, then one probe
    for _ in range(Speculator.MEASURED_AFTER):  # one sequence: learned apart (plain steps first, then verifying)
        speculator.step_timed(1, 1, 1, 0.002, speculated=False)
    assert speculator.plan(seqs[:1], 1)


def test_a_new_step_starts_the_step_costs_again():
    """compile: background swaps the eager step for the compiled one while the replica serves: the step line and
    the per-token averages timed the eager step, so they start again (and only when the step changed)."""
    speculator = Speculator(SpeculativeConfig(max_tokens=2))
    for _ in range(10):
        speculator.step_timed(16, 16, 16, 0.050, speculated=False)
        speculator.step_timed(16, 20, 18, 0.080, speculated=True)
    speculator.step_is(0)  # the step it timed: nothing changes
    assert speculator.cost.known and speculator._mode(16) == "off"
    speculator.step_is(1)  # the compiled step took over
    assert not speculator.cost.known and not speculator.verify.known and not speculator._per_token
    speculator.step_timed(16, 16, 16, 0.020, speculated=False)
    speculator.step_is(1)
    assert speculator.cost.line()[0] + 16 * speculator.cost.line()[1] == pytest.approx(0.020)


def test_a_pause_does_not_turn_speculation_on_and_a_probe_that_changes_the_choice_probes_sooner():
    """A step stalled by a pause (the collector, the OS) counts as at most PAUSE times its average: one 480 ms
    step among 50 ms ones does not make verifying look cheaper. A probe after which the choice changed resets the
    wait for the next probe to PROBE_EVERY."""
    speculator = Speculator(SpeculativeConfig(max_tokens=4))
    for _ in range(10):
        speculator.step_timed(16, 16, 16, 0.050, speculated=False)
        speculator.step_timed(16, 20, 18, 0.080, speculated=True)  # 4.4 ms per token against 3.1
    speculator.step_timed(16, 16, 16, 0.480, speculated=False)  # 30 ms a token: unbounded, the mean would be 5.8
    assert speculator._per_token[5][0].mean == pytest.approx(0.9 * 0.050 / 16 + 0.1 * 2 * 0.050 / 16)
    assert speculator._mode(16) == "off"
    for _ in range(Speculator.PROBE_EVERY):
        speculator._declined(True)
    assert speculator._mode(16) == "trim"  # a probe ...
    speculator._declined(False)
    for _ in range(20):  # ... whose step (and what followed it) verified cheaply: the choice changes
        speculator.step_timed(16, 20, 18, 0.040, speculated=True)
    assert speculator._mode(16) == "trim" and speculator._probe_every[5] == Speculator.PROBE_EVERY
    assert speculator._mode(16) == "trim"
