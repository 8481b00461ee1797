"""Prefill and decode engines joined by connectors: a request prefilled on one engine decodes on the other with
the tokens of a colocated run; every failure (refused or dropped connection, a dead peer, a lease that runs out,
a corrupted message, an abort from either side at any moment) ends both sides in a defined state, frees every
block, and the next transfer succeeds. Each case runs over real UCX on loopback and over the fake transport."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferState
from tests.kv_transfer.faults import EnginePair, LayerTap, start_child_side
from tests.kv_transfer.kv_helpers import wait_until
from tests.kv_transfer.kv_helpers import TRANSPORTS, nowhere

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
D = TransferState.DONE


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    encode = tiny_llama.tokenizer.encode
    return [encode("The quick brown fox jumps over the lazy dog, and then " * 2), encode("Hello there, general")]


@pytest.fixture(scope="module")
def colocated(tiny_llama, prompts):
    """Output tokens of each (prompt, params) run in one engine, the reference."""
    engine = LLMEngine(tiny_llama, EngineConfig(num_kv_blocks=24))
    runs = {}
    for i, prompt in enumerate(prompts):
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            engine.add_request(f"{i}-{name}", prompt, params)
            tokens = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.extend(out.token_ids)
            runs[(i, name)] = tokens
    return runs


@pytest.fixture
def rid(request) -> str:
    """A transfer id of this test's own: a message an earlier test's pair left in flight carries another tag."""
    return f"r-{request.node.name}"


@pytest.fixture(params=TRANSPORTS)
def pair(request, tiny_llama):
    pair = EnginePair(tiny_llama, request.param)
    yield pair
    pair.close()


def next_transfer_succeeds(pair: EnginePair, prompts, colocated, request_id: str = "next") -> None:
    assert pair.transfer(request_id, prompts[0], GREEDY) == colocated[(0, "greedy")]
    pair.assert_clean()


def test_decoding_after_transfer_equals_a_colocated_run(pair, prompts, colocated):
    """Both sides in this process share a host: the prefill side's KV goes by reference, read by the decode side
    straight from the prefill side's shared store (no staging slot is ever taken on the prefill side), and each
    request's blocks there are held until its transfer is DONE."""
    for i, prompt in enumerate(prompts):
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            assert pair.transfer(f"{i}-{name}", prompt, params) == colocated[(i, name)], (i, name)
            assert pair.prefill.engine.scheduler.kv.num_holds == 0  # released at DONE
    sender = pair.prefill.agent.stats()
    if pair.config.shared_memory:
        assert sender.by_reference == sender.from_store == 4 * pair.loaded.config.num_layers  # a message per layer
    assert sender.one_off_buffers == 0
    pair.assert_clean()
    stats = pair.decode.engine.stats()
    assert stats.num_prompt_tokens_queried == sum(2 * len(p) for p in prompts)
    assert stats.num_tokens_computed == 4 * (GREEDY.max_tokens - 1)  # decode computed no prompt token


def test_one_token_requests_finish_at_admission(pair, prompts):
    params = SamplingParams(max_tokens=1, temperature=0)
    desc = pair.reserve("one", prompts[1], params)
    pair.pc.submit("one", prompts[1], params, desc)
    pair.run_prefill()
    assert pair.settle("one") == (D, D)
    outputs = pair.dc.admit("one", pair.first["one"])
    assert outputs[0].finished and outputs[0].finish_reason == "length"
    pair.assert_clean()


def test_a_reservation_that_does_not_fit_holds_nothing(pair, prompts):
    hog = SamplingParams(max_tokens=200, temperature=0)
    long_prompt = (prompts[0] * 4)[:96]  # six blocks each: four reservations fill the 24-block pool
    descs = [pair.reserve(f"hog-{i}", long_prompt, hog) for i in range(5)]
    assert descs[-1] is None and all(d is not None for d in descs[:-1])
    assert pair.decode.engine.stats().num_waiting_for_kv == 4
    for i in range(4):
        pair.dc.abort(f"hog-{i}")
    pair.assert_clean()


def test_refused_connection(rid, pair, prompts, colocated):
    desc = pair.reserve(rid, prompts[0], GREEDY, lease_s=1.5)
    pair.pc.submit(rid, prompts[0], GREEDY, dataclasses.replace(desc, addresses=(nowhere(pair.kind),)))
    pair.run_prefill()
    assert pair.settle(rid) == (TransferState.FAILED, TransferState.EXPIRED)
    assert "send" in pair.prefill.events[rid].error and "lease" in pair.decode.events[rid].error
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


def assert_told_of_failure(pair, rid: str, why: tuple[str, ...]) -> None:
    """The sender's transfer FAILED and the receiver's too, for one of the reasons `why`, at once: not at its lease,
    and with no message dropped as forged. (Over UCX the sender's ABORT once reached the receiver garbled, about one
    run in ten: a second close of the peer's connection, for a send that had failed on the old one, closed the
    new one the ABORT was queued on, and the transport let the ABORT's buffer go while UCX still flushed it out.)"""
    prefill_state, decode_state = pair.settle(rid)
    assert (prefill_state, decode_state) == (TransferState.FAILED, TransferState.FAILED)
    assert any(reason in pair.decode.events[rid].error for reason in why), pair.decode.events[rid].error
    assert pair.decode.agent.stats().drops.forged == 0, pair.decode.agent.stats().drops


def test_dropped_connection(rid, pair, prompts, colocated):
    pair.prefill.transport.drop_at = 1  # the second message's connection goes down under it
    desc = pair.reserve(rid, prompts[0], GREEDY, lease_s=3.0)
    pair.pc.submit(rid, prompts[0], GREEDY, desc)
    pair.run_prefill()
    # Either the receiver saw the connection go under a message, or the sender told it over a new connection,
    # or (payloads by reference) the receiver read a slot the failed sender had already taken back.
    assert_told_of_failure(pair, rid, ("receive failed", "source rank 0", "took its slot back"))
    # by reference, the decode side read the prefill side's blocks in place; its answer to the failure (an ACK,
    # after which it reads nothing more) lets the held blocks go without waiting for the lease
    wait_until(lambda: (pair.poll(), pair.prefill.engine.scheduler.kv.num_holds == 0)[1], timeout_s=10,
               what="the prefill side's held blocks to be released once the decode side answered")
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


def test_a_drill_that_drops_the_connections_mid_transfer_fails_it_on_both_sides(rid, pair, prompts, colocated):
    """KVTransferAgent.drop_connections (ReplicaShell.inject_fault's drill) once layer 0 is on the wire: the
    transfer fails on the sender, the receiver is told, nothing stays held and the next transfer reconnects."""
    desc = pair.reserve(rid, prompts[0], GREEDY, lease_s=3.0)
    dropped = []
    tap = LayerTap(pair.prefill.agent, lambda layer: dropped.append(pair.prefill.agent.drop_connections())
                   if layer == 1 else None)
    pair.pc.submit(rid, prompts[0], GREEDY, desc)
    pair.run_prefill()
    assert dropped == [1]
    # The sender's ABORT, or (payloads by reference) a slot it took back when it failed, read after that.
    assert_told_of_failure(pair, rid, ("source rank 0", "took its slot back"))
    tap.remove()
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


def test_a_corrupted_message_fails_the_transfer_at_once_not_at_its_lease(rid, pair, prompts, colocated):
    """A flipped payload bit fails the message's MAC: the receiver drops it unread (it cannot tell corruption
    from forgery) and counts it; once every other message is in, the transfer fails on both sides within a second
    (BAD_MESSAGE to the sender), long before its 30 s lease, so the request falls back at once."""
    pair.prefill.transport.corrupt = 1
    desc = pair.reserve(rid, prompts[0], GREEDY, lease_s=30.0)
    start = time.monotonic()
    pair.pc.submit(rid, prompts[0], GREEDY, desc)
    pair.run_prefill()
    assert pair.settle(rid, timeout_s=10.0) == (TransferState.FAILED, TransferState.FAILED)
    assert time.monotonic() - start < 5.0
    assert pair.decode.agent.stats().drops.forged == 1
    assert "never arrived intact" in pair.decode.events[rid].error
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


def local_tokens(pair: EnginePair, request_id: str, prompt, params) -> list[int]:
    """The fallback of a failed transfer: the decode side prefills the prompt itself."""
    engine = pair.decode.engine
    engine.add_request(request_id, prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.token_ids)
    return tokens


@pytest.mark.parametrize("every", [16, 7, 3])
def test_injected_transport_faults_end_in_the_right_tokens_or_a_prompt_fallback_and_never_leak(every, pair,
                                                                                                prompts, colocated):
    """Every `every`-th send on both sides is corrupted, failed or lost (FaultyTransport.fault_every): each
    transfer ends DONE with the colocated run's tokens or ends FAILED / EXPIRED within its short lease, its
    request falling back to a prefill on the decode side (the colocated tokens too); nothing leaks either way."""
    for side in (pair.prefill, pair.decode):
        side.transport.fault_every = every
    ended = []
    for i in range(6):
        rid, p = f"fault-{every}-{i}", i % 2
        desc = pair.reserve(rid, prompts[p], GREEDY, lease_s=2.0)
        pair.pc.submit(rid, prompts[p], GREEDY, desc)
        pair.run_prefill()
        states = pair.settle(rid, timeout_s=15.0)
        ended.append(states)
        if states == (D, D):
            assert pair.decode_rest(rid) == colocated[(p, "greedy")], (rid, states)
        else:
            assert states[1] in (TransferState.FAILED, TransferState.EXPIRED, None), (rid, states)
            if pair.dc.state(rid) is not None:  # a reservation still held on the decode side is given up
                pair.dc.abort(rid)
            assert local_tokens(pair, f"{rid}-local", prompts[p], GREEDY) == colocated[(p, "greedy")]
        pair.assert_clean()
    for side in (pair.prefill, pair.decode):
        side.transport.fault_every = None
    injected = sum(sum(side.transport.injected.values()) for side in (pair.prefill, pair.decode))
    assert injected > 0 and (every > 3 or any(states != (D, D) for states in ended)), ended
    next_transfer_succeeds(pair, prompts, colocated)


def test_decode_peer_dies_mid_transfer(rid, pair, prompts, colocated):
    """The decode side dies once layer 0 is sent: its ranks' process is SIGKILLed (UCX) or its transport
    vanishes (fake). The prefill side ends FAILED (its sends are refused or reset) or EXPIRED (if the death went
    unnoticed until the lease), frees everything, and reaches the next decode replica by itself."""
    if pair.kind == "ucx":
        child, conn = start_child_side("decode", str(pair.loaded.source), pair.config.secret)
        conn.send((prompts[0], GREEDY, 3.0, pair.pc.addresses))
        desc = conn.recv()
        kill = lambda: (os.kill(child.pid, signal.SIGKILL), child.join())  # noqa: E731
    else:
        desc = pair.reserve(rid, prompts[0], GREEDY, lease_s=3.0)
        kill = pair.decode.transport.inner.kill
    tap = LayerTap(pair.prefill.agent, lambda layer: kill() if layer == 1 else None)
    pair.pc.submit(rid, prompts[0], GREEDY, desc)
    pair.run_prefill()
    assert pair.settle(rid)[0] in (TransferState.FAILED, TransferState.EXPIRED)
    tap.remove()
    if pair.kind == "fake":  # the decode driver outlived its transport here: its lease frees the blocks
        assert pair.settle(rid)[1] is TransferState.EXPIRED
        pair.replace_decode()
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


def test_prefill_peer_dies_mid_transfer(rid, pair, prompts, colocated):
    """The prefill side dies after layer 0 left: SIGKILL of its process (UCX) or its transport vanishing
    (fake). The decode side ends EXPIRED (the rest never comes) or FAILED (a receive the death cut short),
    frees its blocks, and takes the next transfer from another prefill replica."""
    desc = pair.reserve(rid, prompts[0], GREEDY, lease_s=3.0)
    if pair.kind == "ucx":
        child, conn = start_child_side("prefill", str(pair.loaded.source), pair.config.secret)
        conn.send((prompts[0], GREEDY, desc))
        assert conn.recv() == "submitted"
        child.join(timeout=60)
        assert child.exitcode == -signal.SIGKILL
    else:
        def kill_prefill(layer):
            if layer == 1:
                tap.cut = True
                pair.prefill.transport.inner.kill()
        tap = LayerTap(pair.prefill.agent, kill_prefill)
        pair.pc.submit(rid, prompts[0], GREEDY, desc)
        pair.run_prefill()
        pair.replace_prefill()
    assert pair.settle(rid)[1] in (TransferState.EXPIRED, TransferState.FAILED)
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


def test_lease_runs_out_with_no_sender(rid, pair, prompts, colocated):
    pair.reserve(rid, prompts[0], GREEDY, lease_s=0.3)
    assert pair.decode.engine.stats().num_blocks_in_use > 0
    assert pair.settle(rid) == (None, TransferState.EXPIRED)
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


def test_sender_lease_runs_out_when_acknowledgements_never_come(rid, pair, prompts, colocated):
    pair.decode.transport.swallow_acks = True
    desc = pair.reserve(rid, prompts[0], GREEDY, lease_s=1.0)
    pair.pc.submit(rid, prompts[0], GREEDY, desc)
    pair.run_prefill()
    assert pair.settle(rid, timeout_s=0.5 + 10)[0] is TransferState.EXPIRED
    assert pair.decode.events[rid].state is TransferState.EXPIRED  # done, never admitted: the lease frees it
    # no answer ever came: the blocks the decode side read in place stay held until its lease and the grace
    pair.poll()
    assert pair.prefill.engine.scheduler.kv.num_holds == (1 if pair.config.shared_memory else 0)
    pair.decode.transport.swallow_acks = False
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)


ABORTS = ["decode-after-reserve", "decode-mid-transfer", "decode-after-done", "prefill-after-submit",
          "prefill-mid-transfer"]


@pytest.mark.parametrize("moment", ABORTS)
def test_abort_at_any_moment_from_either_side(rid, pair, prompts, colocated, moment):
    desc = pair.reserve(rid, prompts[0], GREEDY)
    if moment == "decode-after-reserve":
        pair.dc.abort(rid)
    tap = LayerTap(pair.prefill.agent, lambda layer: None)
    if moment == "decode-mid-transfer":
        tap.on_layer = lambda layer: pair.dc.abort(rid) if layer == 1 else None
    if moment == "prefill-mid-transfer":
        def stop_at_layer_1(layer):
            tap.cut = tap.cut or layer == 1
        tap.on_layer = stop_at_layer_1
    pair.pc.submit(rid, prompts[0], GREEDY, desc)
    if moment == "prefill-after-submit":
        pair.pc.abort(rid)
    pair.run_prefill()
    if moment == "prefill-mid-transfer":
        pair.pc.abort(rid)  # the client went away while layer 0 was on the wire and the rest never left
    if moment == "decode-after-done":
        assert pair.settle(rid) == (D, D)
        pair.dc.abort(rid)
    prefill_state, decode_state = pair.settle(rid)
    expected = {
        "decode-after-reserve": (TransferState.ABORTED, None),  # the sender learns it from the refusal
        "decode-mid-transfer": (TransferState.ABORTED, None),
        "decode-after-done": (D, D),
        "prefill-after-submit": (None, TransferState.ABORTED),
        "prefill-mid-transfer": (None, TransferState.ABORTED),
    }[moment]
    assert (prefill_state, decode_state) == expected
    assert pair.pc.state(rid) is None and pair.dc.state(rid) is None
    tap.remove()
    pair.assert_clean()
    next_transfer_succeeds(pair, prompts, colocated)
