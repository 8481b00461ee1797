from __future__ import annotations

import pytest
import torch

from tandem.engine.sampler import make_generator, sample
from tandem.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 2.5, 1.0, -1.0])


def _draws(params: SamplingParams, n: int = 400) -> set[int]:
    generator = make_generator(params)
    return {sample(LOGITS, params, generator) for _ in range(n)}


def test_greedy_and_degenerate_filters_pick_the_argmax():
    assert _draws(SamplingParams(temperature=0)) == {1}
    assert _draws(SamplingParams(temperature=1.0, top_k=1, seed=0)) == {1}
    assert _draws(SamplingParams(temperature=1.0, top_p=0.01, seed=0)) == {1}


def test_top_k_and_top_p_limit_the_support():
    assert _draws(SamplingParams(temperature=1.0, top_k=2, seed=0)) == {1, 2}
    # probabilities ~ [0.03, 0.55, 0.34, 0.07, 0.01]: 0.8 of the mass needs the top two, 0.9 the top three
    assert _draws(SamplingParams(temperature=1.0, top_p=0.8, seed=0)) == {1, 2}
    assert _draws(SamplingParams(temperature=1.0, top_p=0.9, seed=0)) == {1, 2, 3}


def test_same_seed_same_draws():
    params = SamplingParams(temperature=1.5, seed=11)
    g1, g2 = make_generator(params), make_generator(params)
    assert [sample(LOGITS, params, g1) for _ in range(50)] == [sample(LOGITS, params, g2) for _ in range(50)]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
])
def test_invalid_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
