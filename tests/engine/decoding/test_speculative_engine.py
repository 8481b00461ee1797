"""Speculative decoding in the engine's step (engine/decoding/speculation.py): every proposer leaves the output exactly
as without speculation (greedy and sampled, under batching, preemption, prefix caching, stop conditions and a split
replica), rejected proposals never leave KV behind, and a step with a prompt chunk verifies none when adaptive (the
cost model itself: test_speculation_arbiter.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.decoding.draft_proposer import SELF, load_draft
from tandem.engine.engine_config import EngineConfig, SpeculativeConfig
from tandem.engine.kv.kv_events import BlockStored, KVEventRecorder
from tandem.engine.loader import load_model
from tandem.engine.parallel import ParallelConfig
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
