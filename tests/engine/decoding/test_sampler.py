"""The batched sampler: filter supports, penalty arithmetic, log-probs, and draws that depend only on (seed, step)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tandem.engine.decoding.sampler import SampleRequest, apply_penalties, sample_batch
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams

# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
P4 = [0.5, 0.3, 0.15, 0.05]
LOGITS4 = torch.tensor([math.log(p) for p in P4])


def _row(params: SamplingParams, seed: int = 0, step: int = 0, prompt=(), output=()) -> SampleRequest:
    return SampleRequest(params, seed, step, tuple(prompt), tuple(output))


def _support(logits: torch.Tensor, params: SamplingParams, draws: int = 400) -> set[int]:
    """The tokens drawn for one distribution over `draws` steps, as one batch."""
    rows = [_row(params, seed=5, step=s) for s in range(draws)]
    return {t.token_id for t in sample_batch(logits.expand(draws, -1), rows)}


def _one(logits: torch.Tensor, row: SampleRequest) -> SampledToken:
    return sample_batch(logits.unsqueeze(0), [row])[0]


def test_greedy_picks_the_argmax_and_the_first_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 2.0]])
    plain = [_row(SamplingParams(temperature=0)) for _ in range(3)]
    with_logprobs = [_row(SamplingParams(temperature=0, logprobs=1)) for _ in range(3)]  # not the fast path
    assert [t.token_id for t in sample_batch(logits, plain)] == [1, 0, 3]
    assert [t.token_id for t in sample_batch(logits, with_logprobs)] == [1, 0, 3]


def test_top_k_limits_the_support():
    assert _support(LOGITS4, SamplingParams(top_k=1)) == {0}
    assert _support(LOGITS4, SamplingParams(top_k=2)) == {0, 1}
    assert _support(LOGITS4, SamplingParams(top_k=3)) == {0, 1, 2}
    for disabled in (0, -1, 4, 100):
        assert _support(LOGITS4, SamplingParams(top_k=disabled)) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_set_that_reaches_the_mass():
    assert _support(LOGITS4, SamplingParams(top_p=0.4)) == {0}  # 0.5 alone reaches 0.4
    assert _support(LOGITS4, SamplingParams(top_p=0.7)) == {0, 1}  # 0.5 + 0.3
    assert _support(LOGITS4, SamplingParams(top_p=0.9)) == {0, 1, 2}  # 0.5 + 0.3 + 0.15
    assert _support(LOGITS4, SamplingParams(top_p=1e-6)) == {0}  # always at least one token


def test_top_p_on_a_flat_distribution_over_a_large_vocabulary():
    # 4096 equal tokens: top_p 0.5 keeps exactly 2048 of them, more than the candidates sorted first. The
    # peaked row in the same batch is resolved from its candidates alone.
    flat, peaked = torch.zeros(4096), torch.full((4096,), -30.0)
    peaked[[10, 20, 30]] = torch.tensor([2.0, 1.5, 0.0])
    supports = [set(), set()]
    for step in range(300):
        rows = [_row(SamplingParams(top_p=0.5), seed=3, step=step), _row(SamplingParams(top_p=0.9), step=step)]
        for support, token in zip(supports, sample_batch(torch.stack([flat, peaked]), rows)):
            support.add(token.token_id)
    assert max(supports[0]) < 2048 and len(supports[0]) > 250
    assert supports[1] == {10, 20}  # probabilities ~0.57, 0.35, 0.08


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    assert _support(LOGITS4, SamplingParams(min_p=0.2)) == {0, 1, 2}  # threshold 0.1
    assert _support(LOGITS4, SamplingParams(min_p=0.5)) == {0, 1}  # threshold 0.25
    assert _support(LOGITS4, SamplingParams(min_p=1.0)) == {0}


def test_filters_apply_after_temperature_and_top_p_after_top_k():
    # At temperature 0.5 the probabilities become ~0.685, 0.247, 0.062, 0.007: top_p 0.6 keeps one token.
    assert _support(LOGITS4, SamplingParams(top_p=0.6)) == {0, 1}
    assert _support(LOGITS4, SamplingParams(temperature=0.5, top_p=0.6)) == {0}
    # Alone, top_p 0.83 needs three tokens (0.8 < 0.83); after top_k=3 renormalizes, two reach 0.842.
    assert _support(LOGITS4, SamplingParams(top_p=0.83)) == {0, 1, 2}
    assert _support(LOGITS4, SamplingParams(top_k=3, top_p=0.83)) == {0, 1}


def test_mixed_batch_applies_each_rows_own_filters():
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.7), SamplingParams(min_p=0.2), SamplingParams(),
              SamplingParams(temperature=0)]
    supports = [set() for _ in params]
    for step in range(300):
        rows = [_row(p, seed=9, step=step) for p in params]
        for support, token in zip(supports, sample_batch(LOGITS4.expand(len(rows), -1), rows)):
            support.add(token.token_id)
    assert supports == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0}]


def test_empirical_frequencies_match_the_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor([math.log(p) for p in probs])
    draws = 2000
    rows = [_row(SamplingParams(), seed=123, step=s) for s in range(draws)]
    counts = Counter(t.token_id for t in sample_batch(logits.expand(draws, -1), rows))
    for token, p in enumerate(probs):
        # The standard deviation of a frequency is at most ~0.011 here: 0.04 is over 3.5 of them.
        assert abs(counts[token] / draws - p) < 0.04, (token, counts)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    before = logits.clone()
    row = _row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1, 3])
    out = apply_penalties(logits, [row])
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.5, -2.0]]
    assert torch.equal(logits, before)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = _row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[0, 2], output=[1, 1, 3])
    # token 1: 2 occurrences -> -(0.5 + 2 * 0.25); token 3: one -> -(0.5 + 0.25); prompt tokens untouched
    assert apply_penalties(logits, [row]).tolist() == [[2.0, -2.0, 0.5, 2.25, -2.0]]
    negative = _row(SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), output=[4])
    assert apply_penalties(logits, [negative]).tolist() == [[2.0, -1.0, 0.5, 3.0, -0.5]]


def test_penalties_apply_repetition_first_and_only_to_their_own_row():
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    rows = [_row(SamplingParams(repetition_penalty=4.0, presence_penalty=1.0), output=[0]),
            _row(SamplingParams(), output=[0])]
    assert apply_penalties(logits, rows).tolist() == [[2.0 / 4.0 - 1.0, -1.0, 0.5], [2.0, -1.0, 0.5]]


def test_a_penalty_changes_the_greedy_choice():
    logits = torch.tensor([1.0, 0.9])
    assert _one(logits, _row(SamplingParams(temperature=0), output=[0])).token_id == 0
    assert _one(logits, _row(SamplingParams(temperature=0, presence_penalty=0.2), output=[0])).token_id == 1
    assert _one(logits, _row(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])).token_id == 1


def test_sampling_does_not_modify_the_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = [_row(SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3,
                                frequency_penalty=0.5, logprobs=3), seed=i, output=[1, 2]) for i in range(3)]
    sample_batch(logits, rows)
    assert torch.equal(logits, before)


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(logprobs=5), SamplingParams(), SamplingParams(logprobs=0),
              SamplingParams(temperature=0.3, top_k=3, repetition_penalty=1.5, logprobs=20)]
    tokens = sample_batch(logits, [_row(p, seed=i, prompt=[0, 1, 2]) for i, p in enumerate(params)])
    raw = torch.log_softmax(logits, dim=-1)
    for i, (token, p) in enumerate(zip(tokens, params)):
        if p.logprobs is None:
            assert token.logprob is None and token.top_logprobs == ()
            continue
        assert token.logprob == pytest.approx(raw[i, token.token_id].item(), abs=1e-5)
        top = raw[i].topk(p.logprobs) if p.logprobs else None
        expected = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        assert [t for t, _ in token.top_logprobs] == [t for t, _ in expected]
        assert [v for _, v in token.top_logprobs] == pytest.approx([v for _, v in expected], abs=1e-5)
        assert all(a >= b for (_, a), (_, b) in zip(token.top_logprobs, token.top_logprobs[1:]))


def _random_rows(count: int, seed: int) -> tuple[torch.Tensor, list[SampleRequest]]:
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_p=0.9, top_k=40),
              SamplingParams(min_p=0.05, logprobs=2), SamplingParams(temperature=1.3, frequency_penalty=0.4)]
    rows = [_row(params[i % len(params)], seed=int(torch.randint(0, 2**62, (1,), generator=g)), step=i,
                 output=[i % 7]) for i in range(count)]
    return torch.randn(count, 200, generator=g) * 2, rows


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
                                    SamplingParams(min_p=0.02, repetition_penalty=1.1)])
def test_a_rows_draw_depends_only_on_its_seed_and_step(params):
    logits = torch.randn(200, generator=torch.Generator().manual_seed(7)) * 2
    for step in range(25):
        row = _row(params, seed=42, step=step, prompt=[1, 2], output=list(range(step)))
        alone = _one(logits, row).token_id
        torch.manual_seed(step)  # torch's global RNG must play no part
        for size, position in [(2, 0), (8, 3), (8, 7), (33, 16)]:
            others, other_rows = _random_rows(size - 1, seed=step * 100 + size)
            batch = torch.cat([others[:position], logits.unsqueeze(0), others[position:]])
            batch_rows = other_rows[:position] + [row] + other_rows[position:]
            assert sample_batch(batch, batch_rows)[position].token_id == alone, (step, size, position)


def test_different_seeds_and_steps_give_different_sequences():
    logits = torch.zeros(1, 1000)  # uniform: any dependence on (seed, step) shows
    sequences = [[_one(logits[0], _row(SamplingParams(), seed=seed, step=step)).token_id for step in range(30)]
                 for seed in range(6)]
    assert len({tuple(s) for s in sequences}) == 6
    assert all(len(set(s)) > 20 for s in sequences)
    again = [_one(logits[0], _row(SamplingParams(), seed=0, step=step)).token_id for step in range(30)]
    assert again == sequences[0]


def test_logits_shape_must_match_the_rows():
    with pytest.raises(ValueError, match=r"logits must be \[len\(rows\), vocab\]"):
        sample_batch(torch.zeros(2, 5), [_row(SamplingParams())])
    assert sample_batch(torch.zeros(0, 5), []) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, r"n must be at least 1"),
    ({"max_tokens": 0}, r"max_tokens must be at least 1"),
    ({"max_tokens": 2.5}, r"max_tokens must be an integer"),
    ({"temperature": -0.5}, r"temperature must be >= 0"),
    ({"temperature": float("nan")}, r"temperature must be a finite number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, r"top_k must be >= 1, or 0 or -1 to disable it"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -2.1}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
    ({"stop": ["ok", ""]}, r"stop strings must not be empty"),
    ({"stop": [3]}, r"stop must be a string or a list of strings"),
    ({"stop_token_ids": [2, -1]}, r"stop_token_ids must be >= 0, got -1"),
    ({"seed": 1.5}, r"seed must be an integer"),
    ({"seed": "7"}, r"seed must be an integer"),
])
def test_invalid_params_name_the_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_accept_lists_and_boundary_values():
    params = SamplingParams(stop_token_ids=[3, 4], stop=["\n\n", "###"], top_k=-1, logprobs=20, seed=0,
                            presence_penalty=-2, frequency_penalty=2, min_p=1, top_p=1)
    assert params.stop_token_ids == (3, 4) and params.stop == ("\n\n", "###")
    assert params.top_k == -1 and not params.top_k_enabled
    assert hash(params) == hash(SamplingParams(stop_token_ids=(3, 4), stop=("\n\n", "###"), top_k=-1,
                                               logprobs=20, seed=0, presence_penalty=-2, frequency_penalty=2,
                                               min_p=1, top_p=1))
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy


def test_check_vocab_rejects_stop_token_ids_outside_the_vocabulary():
    SamplingParams(stop_token_ids=[0, 99]).check_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 100 is outside the vocabulary \(0..99\)"):
        SamplingParams(stop_token_ids=[5, 100]).check_vocab(100)
