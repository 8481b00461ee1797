"""A prefix pulled from the replica that caches it (kv_transfer/connector.py: DecodeConnector.reserve and
keep_prefix on the puller, PrefillConnector.send_prefix on the holder): the puller then serves a prompt that
extends the prefix from its own prefix cache with the tokens of a run that computed everything, over real UCX on
loopback and over the fake transport (by reference from the holder's shared store); a prefix the holder no longer
caches, or a pull aborted from either side, holds nothing anywhere afterwards."""

from __future__ import annotations

import pytest

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv.prefix_cache import block_hashes
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferState
from tests.kv_transfer.faults import EnginePair
from tests.kv_transfer.kv_helpers import TRANSPORTS

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def texts(tiny_llama):
    encode = tiny_llama.tokenizer.encode
    history = encode("A long conversation about the history of tea, its trade routes and its ceremonies. " * 4)
    return history, history + encode(" What happened next in the story?")


@pytest.fixture(scope="module")
def reference(tiny_llama, texts):
    """The follow-up prompt's tokens, computed in one engine from scratch."""
    engine = LLMEngine(tiny_llama, EngineConfig(num_kv_blocks=24))
    engine.add_request("ref", texts[1], GREEDY)
    return run(engine)["ref"]


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


@pytest.fixture(params=TRANSPORTS)
def pair(request, tiny_llama):
    pair = EnginePair(tiny_llama, request.param)
    yield pair
    pair.close()


def holder_caches(pair: EnginePair, tokens) -> tuple[int, ...]:
    """The holder (the pair's prefill side) computes `tokens` and keeps their full blocks cached; their hashes."""
    pair.prefill.engine.add_request("history", tokens, GREEDY)
    run(pair.prefill.engine)
    return tuple(block_hashes(tokens, BLOCK))


def pull(pair: EnginePair, pull_id: str, tokens, hashes):
    """The puller (the decode side) reserves the prefix's whole blocks, the holder sends those it lacks."""
    prefix = tokens[:len(hashes) * BLOCK]
    descriptor = pair.dc.reserve_prefix(pull_id, prefix, senders=pair.pc.addresses)
    assert descriptor is not None
    pair.pc.send_prefix(pull_id, hashes[len(hashes) - descriptor.num_tokens // BLOCK:], descriptor)
    return descriptor


def test_a_pulled_prefix_serves_the_next_turn_with_identical_output(pair, texts, reference):
    history, follow_up = texts
    hashes = holder_caches(pair, history)
    assert len(hashes) >= 4
    pull(pair, "pull-1", history, hashes)
    assert pair.settle("pull-1") == (TransferState.DONE, TransferState.DONE)
    assert pair.dc.keep_prefix("pull-1") == len(hashes)
    assert pair.prefill.engine.scheduler.kv.num_holds == 0  # the holder let go at DONE
    puller = pair.decode.engine
    assert puller.stats().num_blocks_in_use == 0 and puller.stats().num_blocks_cached == len(hashes)
    puller.add_request("next", follow_up, GREEDY)
    assert run(puller)["next"] == reference
    stats = puller.stats()
    assert stats.num_prompt_tokens_cached == len(hashes) * BLOCK  # the whole prefix came from the pull
    assert stats.num_tokens_computed == len(follow_up) - len(hashes) * BLOCK + GREEDY.max_tokens - 1
    pair.assert_clean()


def test_a_puller_that_caches_the_first_blocks_receives_only_the_rest(pair, texts, reference):
    history, follow_up = texts
    hashes = holder_caches(pair, history)
    puller = pair.decode.engine
    puller.add_request("own", history[:3 * BLOCK + 5], GREEDY)  # the puller computed the first 3 blocks itself
    run(puller)
    descriptor = pull(pair, "tail", history, hashes)
    assert descriptor.num_tokens == (len(hashes) - 3) * BLOCK  # only the blocks it lacked are sent
    assert pair.settle("tail") == (TransferState.DONE, TransferState.DONE)
    assert pair.dc.keep_prefix("tail") == len(hashes)
    before = puller.stats().num_tokens_computed
    puller.add_request("next", follow_up, GREEDY)
    assert run(puller)["next"] == reference
    assert puller.stats().num_tokens_computed - before == len(follow_up) - len(hashes) * BLOCK + GREEDY.max_tokens - 1
    pair.assert_clean()


def test_a_prefix_the_holder_no_longer_caches_is_refused_and_nothing_is_held(pair, texts, reference):
    history, follow_up = texts
    hashes = holder_caches(pair, history)
    pair.prefill.engine.kv_manager.reset_prefix_cache()  # evicted since the router last heard
    descriptor = pair.dc.reserve_prefix("gone", history[:len(hashes) * BLOCK], senders=pair.pc.addresses)
    with pytest.raises(LookupError, match="0 of the prefix's"):
        pair.pc.send_prefix("gone", hashes, descriptor)
    assert pair.prefill.engine.scheduler.kv.num_holds == 0
    pair.dc.abort("gone", "the holder no longer has the prefix")
    assert pair.decode.engine.stats().num_blocks_in_use == 0
    pair.assert_clean()
    pair.decode.engine.add_request("next", follow_up, GREEDY)  # computed in full instead, the same tokens
    assert run(pair.decode.engine)["next"] == reference


@pytest.mark.parametrize("side", ["puller", "holder"])
def test_a_pull_aborted_from_either_side_frees_both(pair, texts, side):
    history, _ = texts
    hashes = holder_caches(pair, history)
    pull(pair, f"abort-{side}", history, hashes)
    (pair.dc if side == "puller" else pair.pc).abort(f"abort-{side}", "the request went elsewhere")
    holder, puller = pair.settle(f"abort-{side}")  # both sides ended; the one that did not abort was told
    told = holder if side == "puller" else puller
    assert told in (TransferState.ABORTED, TransferState.DONE)  # DONE: every block had arrived before the abort
    if side == "holder" and puller is TransferState.DONE:  # what came is whole: it may be kept
        assert pair.dc.keep_prefix(f"abort-{side}") == len(hashes)
    else:
        with pytest.raises(ValueError, match="cannot be kept"):
            pair.dc.keep_prefix(f"abort-{side}")
    pair.assert_clean()
