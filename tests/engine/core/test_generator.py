"""The single-request generator: stop conditions, validation, and KV blocks returned on every exit path."""

from __future__ import annotations

import pytest

from tandem.engine.core.generator import RequestRejectedError
from tandem.engine.sampling_params import SamplingParams


def _all_free(generator) -> bool:
    generator.block_pool.check_integrity()
    return generator.block_pool.num_free == generator.block_pool.num_blocks


def test_abandoned_stream_returns_its_blocks(embedded, embedded_generator):
    stream = embedded_generator.stream(embedded.tokenizer.encode("Once upon a time"), SamplingParams(max_tokens=50))
    next(stream), next(stream)
    assert not _all_free(embedded_generator)
    stream.close()
    assert _all_free(embedded_generator)


def test_stop_token_ends_the_stream(embedded, embedded_generator):
    ids = embedded.tokenizer.encode("The capital of France is")
    greedy = embedded_generator.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop_at = greedy.token_ids[3]
    result = embedded_generator.generate(ids, SamplingParams(max_tokens=8, temperature=0,
                                                             stop_token_ids=(stop_at,)))
    assert result.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    assert result.finish_reason == "stop"
    assert _all_free(embedded_generator)


@pytest.mark.parametrize("ids, error, message", [
    ([], ValueError, "the prompt is empty"),
    ([5, 49152], ValueError, "token id 49152 is outside the vocabulary"),
    ([5] * 2040, RequestRejectedError, "exceeds the maximum context length 2048"),
])
def test_bad_requests_are_rejected_before_any_work(embedded_generator, ids, error, message):
    with pytest.raises(error, match=message):
        embedded_generator.generate(ids, SamplingParams(max_tokens=16))
    assert _all_free(embedded_generator)


def test_seeded_sampling_is_reproducible(embedded, embedded_generator):
    ids = embedded.tokenizer.encode("In a distant galaxy")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=3)
    first = embedded_generator.generate(ids, params).token_ids
    assert embedded_generator.generate(ids, params).token_ids == first
