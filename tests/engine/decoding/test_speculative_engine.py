"""Speculative decoding in the engine's step (engine/decoding/speculation.py): every proposer leaves the output exactly
as without speculation (greedy and sampled, under batching, preemption, prefix caching, stop conditions and a split
replica), rejected proposals never leave KV behind, and the cost model proposes only where it pays."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.decoding.draft_proposer import SELF, load_draft
from tandem.engine.decoding.speculation import Speculator, StepCost
from tandem.engine.engine_config import EngineConfig, SpeculativeConfig
from tandem.engine.kv.kv_events import BlockStored, KVEventRecorder
from tandem.engine.loader import load_model
from tandem.engine.parallel import ParallelConfig
from tandem.engine.request import RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutput
from tests.engine.engine_helpers import run_all
from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids

TOKENS = 40
# Proposals verified in every step the proposer has some (not only where the cost model says they pay): the
# verification path is what these tests check.
EVERY_STEP = {"adaptive": False, "max_tokens": 4}


class RandomProposer:
    """Proposes k random tokens every step: nearly all are rejected (the worst case for KV bookkeeping)."""

    name = "random"

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, seq_id, token_ids, k):
        return [self.rng.randrange(self.vocab) for _ in range(k)]

    def forget(self, seq_id):
        pass


def engine(loaded, speculative: SpeculativeConfig | None, **config) -> LLMEngine:
    settings = {"num_kv_blocks": 256, "max_num_seqs": 4, "check_integrity": True, "enable_prefix_caching": False}
    return LLMEngine(loaded, EngineConfig(**(settings | config), speculative=speculative))


def outputs(e: LLMEngine, prompts, params: SamplingParams | list[SamplingParams]) -> dict:
    for i, ids in enumerate(prompts):
        e.add_request(f"r{i}", ids, params[i] if isinstance(params, list) else params)
    done = run_all(e)
    assert e.stats().num_blocks_in_use == 0  # nothing leaked, rejected proposals included
    return {key: (c.token_ids, c.text, c.finish_reason) for key, c in done.items()}


@pytest.fixture(scope="module")
def parity(embedded):
    return [_prompt_ids(embedded.tokenizer, spec) for _, spec in sorted(PROMPTS.items())]


@pytest.fixture(scope="module")
def greedy_reference(embedded, parity):
    with engine(embedded, None) as e:
        return outputs(e, parity, SamplingParams(max_tokens=TOKENS, temperature=0))


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_greedy_output_is_unchanged_by_each_proposer_on_the_parity_prompts(embedded, parity, greedy_reference,
                                                                         proposer):
    """Seven prompts four at a time: speculating and plain sequences, prefill chunks and decodes share steps."""
    with engine(embedded, SpeculativeConfig(proposer=proposer, **EVERY_STEP), max_num_batched_tokens=64) as e:
        assert outputs(e, parity, SamplingParams(max_tokens=TOKENS, temperature=0)) == greedy_reference
        stats = e.speculation_stats()
    assert stats.proposer == proposer
    assert stats.accepted > 0 and stats.proposed > stats.accepted  # proposals were both accepted and rejected
    assert sum(stats.acceptance_counts) > 0 and stats.acceptance_counts[0] > 0


def test_sampled_output_penalties_and_logprobs_are_unchanged(embedded, parity):
    """Each emitted token is the target's own draw for its step, so a sampled request (n=2, penalties, top-p,
    logprobs) gives the same tokens and log-probabilities as without speculation."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=11, n=2, repetition_penalty=1.1,
                            frequency_penalty=0.3, logprobs=2)
    runs = []
    for speculative in (None, SpeculativeConfig(proposer="suffix", **EVERY_STEP)):
        with engine(embedded, speculative, max_num_seqs=8) as e:
            for i, ids in enumerate(parity[:4]):
                e.add_request(f"r{i}", ids, params)
            done = run_all(e)
            runs.append((done, e.speculation_stats()))
    (plain, _), (speculated, stats) = runs
    assert stats.accepted > 0
    assert {k: c.token_ids for k, c in speculated.items()} == {k: c.token_ids for k, c in plain.items()}
    for key, c in plain.items():
        assert len(c.logprobs) == len(c.token_ids) == len(speculated[key].logprobs)
        for a, b in zip(c.logprobs, speculated[key].logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_preemption_and_heavy_rejection_leave_the_kv_cache_whole(embedded, parity, greedy_reference):
    """Random proposals (nearly all rejected) in a KV cache so small that sequences are preempted: the blocks taken
    for rejected tokens are given back, the integrity check passes after every step, the tokens do not change."""
    blocks = max(-(-(len(ids) + TOKENS) // 16) for ids in parity) + 2  # the largest request and a little more
    e = engine(embedded, SpeculativeConfig(max_tokens=8, adaptive=False), num_kv_blocks=blocks)
    e.scheduler.speculator.proposer = RandomProposer(e.vocab_size)
    spec = e.scheduler.speculator
    held, real_step = [], e.step

    def step():
        out = real_step()
        for seq in e.scheduler.running:  # after a step, a sequence holds the blocks of its tokens, no more
            if not seq.is_prefilling:
                held.append(len(e.kv_manager.block_table(seq.seq_id)) - e.kv_manager.blocks_for(seq.num_tokens))
        return out

    e.step = step
    assert outputs(e, parity, SamplingParams(max_tokens=TOKENS, temperature=0)) == greedy_reference
    assert e.stats().num_preemptions > 0
    assert spec.proposed > 10 * max(spec.accepted, 1)
    assert held and max(held) == 0


@pytest.mark.parametrize("adaptive", [True, False])
def test_adaptive_speculation_proposes_nothing_in_a_step_that_computes_a_prompt_chunk(embedded, parity,
                                                                                    greedy_reference, adaptive):
    """Seven prompts two at a time in 64-token steps: decodes share steps with prompt chunks. Adaptively, those steps
    carry no proposals (they would push the chunk out of the budget); verifying every step, they do."""
    e = engine(embedded, SpeculativeConfig(max_tokens=4, adaptive=adaptive), max_num_seqs=2,
               max_num_batched_tokens=64)
    e.scheduler.speculator.proposer = RandomProposer(e.vocab_size)
    mixed, real_schedule = [], e.scheduler.schedule

    def schedule():
        out = real_schedule()
        if any(n > 1 + len(out.spec_tokens.get(i, ())) for i, n in out.num_scheduled_tokens.items()):
            mixed.append(sum(len(t) for i, t in out.spec_tokens.items()))  # proposals in a step with a chunk
        return out

    e.scheduler.schedule = schedule
    with e:
        assert outputs(e, parity, SamplingParams(max_tokens=TOKENS, temperature=0)) == greedy_reference
        stats = e.speculation_stats()
    assert len(mixed) > len(parity)  # prompt chunks shared steps with decodes
    if adaptive:
        assert sum(mixed) == 0 and stats.declined_steps >= len(mixed) - len(parity)
    else:
        assert sum(mixed) > 0


def test_prefix_cache_sees_only_accepted_tokens(embedded, parity, greedy_reference):
    """Every block the prefix cache registers holds the request's real tokens (prompt and accepted output), never a
    proposal, and a second run of the same prompts hits those blocks and gives the same tokens."""
    events = KVEventRecorder()
    e = LLMEngine(embedded, EngineConfig(num_kv_blocks=256, max_num_seqs=4, check_integrity=True,
                                         speculative=SpeculativeConfig(max_tokens=8, adaptive=False)),
                  event_sink=events)
    e.scheduler.speculator.proposer = RandomProposer(e.vocab_size, seed=1)
    prompts = parity[:4]
    first = outputs(e, prompts, SamplingParams(max_tokens=TOKENS, temperature=0))
    assert first == {k: v for k, v in greedy_reference.items() if k in first}
    real = [list(ids) + list(first[(f"r{i}", 0)][0]) for i, ids in enumerate(prompts)]
    stored = [ev for ev in events.events if isinstance(ev, BlockStored)]
    assert len(stored) > len(prompts)  # output blocks too, not only prompts
    for ev in stored:
        assert any(_block_of(seq, ev.token_ids) for seq in real), ev.token_ids
    e.scheduler.speculator.proposer = RandomProposer(e.vocab_size, seed=2)
    for i, ids in enumerate(prompts):
        e.add_request(f"again{i}", ids, SamplingParams(max_tokens=TOKENS, temperature=0))
    again = run_all(e)
    assert all(again[(f"again{i}", 0)].token_ids == first[(f"r{i}", 0)][0] for i in range(len(prompts)))
    assert sum(c.num_cached_tokens for c in again.values()) > 0


def _block_of(seq: list[int], block: tuple[int, ...]) -> bool:
    """Whether block is one of seq's block-aligned runs of tokens."""
    n = len(block)
    return any(tuple(seq[i:i + n]) == block for i in range(0, len(seq) - n + 1, n))


def test_stop_strings_stop_tokens_and_max_tokens_cut_where_they_cut_without_speculation(embedded, parity,
                                                                                        greedy_reference):
    """Stop conditions met inside a step's accepted tokens end the output at the same token and text."""
    text = greedy_reference[("r0", 0)][1]
    word = text.split()[len(text.split()) // 2]
    stop_token = greedy_reference[("r1", 0)][0][TOKENS // 2]
    params = [SamplingParams(max_tokens=TOKENS, temperature=0, stop=(word,)),
              SamplingParams(max_tokens=TOKENS, temperature=0, stop_token_ids=(stop_token,)),
              SamplingParams(max_tokens=7, temperature=0), SamplingParams(max_tokens=1, temperature=0)]
    runs = []
    for speculative in (None, SpeculativeConfig(proposer="ngram", **EVERY_STEP)):
        e = engine(embedded, speculative)
        e.scheduler.speculator and setattr(e.scheduler.speculator, "proposer", RandomProposer(e.vocab_size))
        runs.append(outputs(e, parity[:4], params))
    assert runs[0] == runs[1]
    assert runs[0][("r0", 0)][2] == "stop" and runs[0][("r1", 0)][2] == "stop"
    assert len(runs[1][("r2", 0)][0]) == 7 and len(runs[1][("r3", 0)][0]) == 1


def test_requests_that_must_not_speculate_do_not(embedded, parity, greedy_reference):
    """speculative_tokens=0 and structured output never get proposals; speculative_tokens=2 gets at most 2."""
    e = engine(embedded, SpeculativeConfig(max_tokens=8, adaptive=False))
    e.scheduler.speculator.proposer = RandomProposer(e.vocab_size)
    seen: dict[str, int] = {}
    schedule = e.scheduler.schedule

    def watched():
        out = schedule()
        for seq_id, tokens in out.spec_tokens.items():
            seen[seq_id] = max(seen.get(seq_id, 0), len(tokens))
        return out

    e.scheduler.schedule = watched
    params = [SamplingParams(max_tokens=TOKENS, temperature=0, speculative_tokens=0),
              SamplingParams(max_tokens=TOKENS, temperature=0, speculative_tokens=2),
              SamplingParams(max_tokens=TOKENS, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutput("regex", "[a-z ]{1,12}"))]
    done = outputs(e, parity[:4], params)
    assert "r0#0" not in seen and "r3#0" not in seen
    assert seen["r1#0"] == 2 and seen["r2#0"] == 8
    assert done[("r0", 0)] == greedy_reference[("r0", 0)] and done[("r2", 0)] == greedy_reference[("r2", 0)]
    assert all(c.islower() or c == " " for c in done[("r3", 0)][1])
    with pytest.raises(ValueError, match="speculative_tokens"):
        SamplingParams(speculative_tokens=17)


def test_a_split_replica_speculates_with_one_process_tokens(embedded, parity, greedy_reference):
    """Pipeline stages in two processes, two micro-batches: the ranks that do not sample learn every emitted
    token, and the last stage returns each speculating sequence's rows."""
    meta = load_model(weights=False, progress=False)
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=4, enable_prefix_caching=False,
                          speculative=SpeculativeConfig(proposer="ngram", **EVERY_STEP))
    with LLMEngine(meta, config, parallel=ParallelConfig(pp=2, micro_batches=2)) as e:
        assert outputs(e, parity[:4], SamplingParams(max_tokens=TOKENS, temperature=0)) == \
            {k: v for k, v in greedy_reference.items() if k[0] in ("r0", "r1", "r2", "r3")}
        assert e.speculation_stats().accepted > 0


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
    does what cost less per emitted token there, with one step of the other after PROBE_EVERY in a row."""
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
    for _ in range(2 * Speculator.PROBE_EVERY + 2):
        later.append(speculator._mode(16))
        speculator._declined(later[-1] == "off")
    probes = [i for i, mode in enumerate(later) if mode == "trim"]
    assert probes == [Speculator.PROBE_EVERY, 2 * Speculator.PROBE_EVERY + 1]
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


# -- the draft model ----------------------------------------------------------------------------------------------

def test_the_packed_twin_drafts_greedy_and_sampled_output_unchanged(embedded, parity, greedy_reference):
    """draft: self (the GGUF's own 4-bit weights, packed) proposes in batched passes with its own KV pool; greedy
    and sampled output equal the output without speculation, most proposals are accepted (the twin agrees with
    its float32 target, and draws its sampled proposals with the same seeds), and every draft block comes back."""
    config = SpeculativeConfig(proposer="draft", **EVERY_STEP)
    with engine(embedded, config, max_num_batched_tokens=64) as e:
        draft = e.scheduler.speculator.proposer
        assert draft.name == "draft" and draft.cost.known  # timed at start
        assert outputs(e, parity, SamplingParams(max_tokens=TOKENS, temperature=0)) == greedy_reference
        greedy = e.speculation_stats()
        assert draft.num_blocks_in_use == 0
    assert greedy.accepted > 0.7 * greedy.proposed
    sampled = SamplingParams(max_tokens=TOKENS, temperature=0.8, top_k=50, seed=5)
    with engine(embedded, None) as e:
        plain = outputs(e, parity[:4], sampled)
    with engine(embedded, config) as e:
        assert outputs(e, parity[:4], sampled) == plain
        stats = e.speculation_stats()
        assert e.scheduler.speculator.proposer.num_blocks_in_use == 0
    assert stats.accepted > 0.5 * stats.proposed


def test_the_draft_survives_preemption_with_one_process_tokens(embedded, parity, greedy_reference):
    blocks = max(-(-(len(ids) + TOKENS) // 16) for ids in parity) + 2
    with engine(embedded, SpeculativeConfig(proposer="draft", **EVERY_STEP), num_kv_blocks=blocks) as e:
        assert outputs(e, parity, SamplingParams(max_tokens=TOKENS, temperature=0)) == greedy_reference
        assert e.stats().num_preemptions > 0 and e.speculation_stats().accepted > 0
        assert e.scheduler.speculator.proposer.num_blocks_in_use == 0


def test_a_draft_the_engine_cannot_run_is_refused_with_the_reason(tmp_path, embedded):
    from tests.engine.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "hf", "llama3", embedded.tokenizer)
    with pytest.raises(ValueError, match="GGUF"):  # a Hugging Face folder has no 4-bit layers to run packed
        LLMEngine(load_model(folder, progress=False), EngineConfig(num_kv_blocks=64,
                                                                   speculative=SpeculativeConfig(proposer="draft")))
    meta = load_model(weights=False, progress=False)
    with pytest.raises(ValueError, match="split over ranks"):
        LLMEngine(meta, EngineConfig(num_kv_blocks=64, speculative=SpeculativeConfig(proposer="draft")),
                  parallel=ParallelConfig(pp=2))
    with pytest.raises(ValueError, match="proposer"):
        SpeculativeConfig(proposer="eagle")
    # Packed 4-bit weights run on the CPU only: on a GPU the draft 'self' is refused before anything is loaded (the
    # H200 run of bench/speculative.py --device cuda found the engine failing deep inside the draft's build).
    with pytest.raises(ValueError, match="only the CPU runs .* on cuda name a smaller model"):
        load_draft(embedded, SELF, torch.device("cuda"))


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
