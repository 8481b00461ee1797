"""The worker replicas (run here in one process, as Ray would run each actor) with their real KV agents over UCX
on loopback: each reports its agents' addresses in ready(); a decode replica answers only the senders its
reservation names, so a transfer that names the prefill replica's addresses completes and one that names none
is decided by the prefill side's lease; and the messages its agents dropped show in stats()."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from tandem.decode_worker.replica import DecodeReplica
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferFailedError, TransferState
from tandem.kv_transfer.drops import MessageDrops
from tandem.kv_transfer.wire import HEADER_BYTES, Kind, make_tag
from tandem.prefill_worker.replica import PrefillReplica
from tandem.replica.spec import ReplicaSpec
from tests.kv_transfer.kv_helpers import make_transport, wait_until

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def replicas(tiny_llama):
    spec = ReplicaSpec(model=str(tiny_llama.source), device="cpu", engine=EngineConfig(num_kv_blocks=24))
    transfer = TransferConfig(lease_s=2.0, max_message_bytes=1 << 20, staging_bytes=4 << 20)  # one secret
    prefill = PrefillReplica("prefill-0", spec, transfer)
    decode = DecodeReplica("decode-0", spec, transfer)
    yield prefill, decode
    for replica in (prefill, decode):
        asyncio.run(replica.shutdown())


async def disaggregated(prefill, decode, request_id: str, prompt, senders) -> list[int]:
    descriptor = await decode.reserve(request_id, prompt, PARAMS, senders=senders)
    result = await prefill.prefill(request_id, prompt, PARAMS, descriptor)
    return [t for batch in [b async for b in decode.decode(request_id, result.first_token)]
            for out in batch for t in out.token_ids]


def test_a_transfer_completes_when_the_reservation_names_the_prefill_agents(replicas, tiny_llama):
    prefill, decode = replicas
    prefill_info, decode_info = asyncio.run(prefill.ready()), asyncio.run(decode.ready())
    assert prefill_info.kv_addresses == prefill.connector.addresses and len(prefill_info.kv_addresses) == 1
    assert decode_info.kv_addresses == decode.connector.addresses
    prompt = tiny_llama.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    tokens = asyncio.run(disaggregated(prefill, decode, "named", prompt, prefill_info.kv_addresses))
    assert len(tokens) == PARAMS.max_tokens
    assert asyncio.run(prefill.stats()).kv_messages_by_reference == 0  # same-host shared memory is opt-in


def test_with_no_senders_named_the_prefill_side_learns_nothing_and_its_lease_ends_it(replicas, tiny_llama):
    prefill, decode = replicas
    prompt = tiny_llama.tokenizer.encode("Hello there, general")
    with pytest.raises(TransferFailedError) as failure:
        asyncio.run(disaggregated(prefill, decode, "unnamed", prompt, ()))
    assert failure.value.state is TransferState.EXPIRED  # the KV arrived, but no acknowledgement was sent
    asyncio.run(decode.abort("unnamed"))


def test_dropped_messages_show_in_the_replica_stats(replicas):
    prefill, decode = replicas
    before = asyncio.run(decode.stats()).kv_messages_dropped
    attacker = make_transport("ucx", None)
    try:
        address = decode.connector.addresses[0]
        for tag, size in ((make_tag(12345, Kind.DATA, 0), HEADER_BYTES + 10), (make_tag(12345, Kind.ACK, 0), 3)):
            wait_until(attacker.send(address, tag, np.zeros(size, dtype=np.uint8)).done, what="the send")

        want = before + MessageDrops(unknown_transfer=1, malformed=1)

        async def dropped() -> MessageDrops:
            for _ in range(400):
                drops = (await decode.stats()).kv_messages_dropped
                if drops.unknown_transfer >= want.unknown_transfer and drops.malformed >= want.malformed:
                    break
                await asyncio.sleep(0.01)
            # "late" is what honest peers cause too: the expired transfer of the test above may still be
            # answering its prefill side's last messages here, so only the other reasons are compared
            return dataclasses.replace(drops, late=want.late)

        assert asyncio.run(dropped()) == want
        assert asyncio.run(prefill.stats()).kv_messages_dropped.forged == 0
    finally:
        attacker.close()
