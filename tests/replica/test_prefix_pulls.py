"""Prefix pulls between worker replicas (run here in one process, as Ray would run each actor) with their real KV
agents over UCX on loopback: the decode replica that decoded a session's first turn sends that turn's blocks (its
prompt and its answer) to the prefill replica, which then computes only the new part of the next turn, with the
tokens of a run that computed everything; a pull of blocks the holder no longer caches fails cleanly and leaves
nothing held on either side; blocks the holder keeps only on its host tier are brought up to its device and sent."""

from __future__ import annotations

import asyncio

import pytest

from tandem.decode_worker.replica import DecodeReplica
from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig, KVTiersConfig
from tandem.engine.kv.kv_events import HOST
from tandem.engine.kv.prefix_cache import block_hashes
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.config import TransferConfig
from tandem.prefill_worker.replica import PrefillReplica
from tandem.replica.spec import ReplicaSpec

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def replicas(tiny_llama):
    spec = ReplicaSpec(model=str(tiny_llama.source), device="cpu", engine=EngineConfig(num_kv_blocks=48))
    transfer = TransferConfig(lease_s=10.0, max_message_bytes=1 << 20, staging_bytes=4 << 20)
    prefill = PrefillReplica("prefill-0", spec, transfer)
    decode = DecodeReplica("decode-0", spec, transfer)
    yield prefill, decode
    for replica in (prefill, decode):
        asyncio.run(replica.shutdown())


async def turn(prefill, decode, request_id: str, prompt) -> tuple[list[int], int]:
    """One disaggregated request: its output tokens and the prompt tokens the prefill replica found cached."""
    senders = (await prefill.ready()).kv_addresses
    descriptor = await decode.reserve(request_id, prompt, PARAMS, senders=senders)
    result = await prefill.prefill(request_id, prompt, PARAMS, descriptor)
    tokens = [t for batch in [b async for b in decode.decode(request_id, result.first_token)]
              for out in batch for t in out.token_ids]
    return tokens, result.num_cached_tokens


def one_process(loaded, prompt) -> list[int]:
    """The prompt's output tokens computed from scratch in one engine."""
    with LLMEngine(loaded, EngineConfig(num_kv_blocks=48)) as reference:
        reference.add_request("ref", prompt, PARAMS)
        tokens = []
        while reference.has_unfinished_requests():
            tokens += [t for out in reference.step() for t in out.token_ids]
    return tokens


def held_depth(replica, hashes) -> int:
    cached = set(replica.engine.cached_block_hashes())
    return next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))


async def wait_idle(*replicas) -> None:
    for _ in range(500):
        if all(stats.kv_blocks_in_use == 0 for stats in [await r.stats() for r in replicas]):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("blocks still in use")


def test_the_next_turn_pulls_the_last_turn_from_the_decode_replica(replicas, tiny_llama):
    prefill, decode = replicas
    encode = tiny_llama.tokenizer.encode
    first = encode("Tell me about the history of the city of Lyon and its silk weavers, please.")

    async def scenario():
        answer, _ = await turn(prefill, decode, "turn-1", first)
        second = first + answer + encode(" And what came after that?")
        hashes = block_hashes(second, BLOCK)
        held, own = held_depth(decode, hashes), held_depth(prefill, hashes)
        assert held > own + 1  # the decode replica holds the answer's blocks too; the prefill replica does not
        descriptor = await prefill.reserve_prefix("pull-1", second[:held * BLOCK],
                                                  senders=(await decode.ready()).kv_addresses)
        assert descriptor.num_tokens == (held - own) * BLOCK  # the prefill replica keeps the blocks it has
        await decode.send_prefix("pull-1", tuple(hashes[own:held]), descriptor)
        assert await prefill.keep_prefix("pull-1") == held
        tokens, cached = await turn(prefill, decode, "turn-2", second)
        await wait_idle(prefill, decode)
        await prefill.check_integrity()
        await decode.check_integrity()
        return second, held, tokens, cached

    second, held, tokens, cached = asyncio.run(scenario())
    assert cached == held * BLOCK  # the pulled blocks were not computed again
    assert tokens == one_process(tiny_llama, second)


def test_a_pull_of_blocks_the_holder_lacks_fails_and_holds_nothing(replicas, tiny_llama):
    prefill, decode = replicas
    never_seen = tiny_llama.tokenizer.encode("Colourless green ideas sleep furiously, " * 4)
    hashes = block_hashes(never_seen, BLOCK)

    async def scenario():
        descriptor = await prefill.reserve_prefix("pull-2", never_seen[:len(hashes) * BLOCK],
                                                  senders=(await decode.ready()).kv_addresses)
        with pytest.raises(LookupError, match="are cached here"):
            await decode.send_prefix("pull-2", tuple(hashes[len(hashes) - descriptor.num_tokens // BLOCK:]),
                                     descriptor)
        await prefill.abort("pull-2")
        await wait_idle(prefill, decode)
        await prefill.check_integrity()
        await decode.check_integrity()

    asyncio.run(scenario())


def test_blocks_the_holder_keeps_only_on_its_host_tier_are_brought_up_and_sent(tiny_llama):
    spec = ReplicaSpec(model=str(tiny_llama.source), device="cpu", engine=EngineConfig(num_kv_blocks=48))
    tiered = ReplicaSpec(model=str(tiny_llama.source), device="cpu",
                         engine=EngineConfig(num_kv_blocks=48, kv_tiers=KVTiersConfig(host_bytes=1 << 28)))
    transfer = TransferConfig(lease_s=10.0, max_message_bytes=1 << 20, staging_bytes=4 << 20)
    prefill, decode = PrefillReplica("prefill-t", spec, transfer), DecodeReplica("decode-t", tiered, transfer)
    encode = tiny_llama.tokenizer.encode
    first = encode("Describe the tides of the Bay of Fundy and the people who fish there, in detail.")

    async def scenario():
        answer, _ = await turn(prefill, decode, "turn-1", first)
        second = first + answer + encode(" Why are they so high?")
        async for _ in decode.generate("nudge", encode("Hi"), SamplingParams(max_tokens=1)):
            pass  # a step after turn 1 ended: its parked blocks are copied to the host tier
        await decode.server.call(lambda engine: engine.kv_manager.reset_prefix_cache())  # gone from the device
        hashes = block_hashes(second, BLOCK)
        held, own = held_depth(decode, hashes), held_depth(prefill, hashes)
        on_host = set(decode.engine.cached_block_hashes(HOST))
        depth = next(i for i, h in enumerate(hashes) if h not in on_host)
        assert held == 0 and depth > own + 1
        descriptor = await prefill.reserve_prefix("pull-t", second[:depth * BLOCK],
                                                  senders=(await decode.ready()).kv_addresses)
        await decode.send_prefix("pull-t", tuple(hashes[own:depth]), descriptor,
                                 prefix_token_ids=tuple(second[:depth * BLOCK]))
        assert await prefill.keep_prefix("pull-t") == depth
        tokens, cached = await turn(prefill, decode, "turn-2", second)
        await wait_idle(prefill, decode)
        await decode.check_integrity()
        return second, depth, tokens, cached, (await decode.stats()).kv_tiers

    try:
        second, depth, tokens, cached, tiers = asyncio.run(scenario())
    finally:
        for replica in (prefill, decode):
            asyncio.run(replica.shutdown())
    assert cached == depth * BLOCK and tiers.host_hits >= depth - 1  # up from the host, then sent
    assert tokens == one_process(tiny_llama, second)
