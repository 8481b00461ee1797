"""What the router does for the KV agents' trust in each other: it names the planned prefill replica's agent
addresses (ReplicaInfo.kv_addresses) when it reserves on a decode replica, the only peers the decode replica's
agents will answer; and it exports the messages every replica's agents dropped on /metrics (with the other
counters replicas report there: their speculative decoding's)."""

from __future__ import annotations

import asyncio

from tandem.engine.decoding.speculation import SpeculationStats
from tandem.kv_transfer.drops import MessageDrops
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.metrics import RouterMetrics
from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tandem.router.replicas import Replica
from tests.router.test_lifecycle import collect, request


def driver_with_info(prefill: MockPrefill, decode: MockDecode) -> RequestDriver:
    """Replicas as the control plane hands them over: with their ready() info."""
    info = lambda replica: asyncio.run(replica.ready())  # noqa: E731
    return RequestDriver([Replica(prefill.name, "prefill", prefill, info(prefill))],
                         [Replica(decode.name, "decode", decode, info(decode))], DriverSettings())


def test_reserve_names_the_planned_prefill_replicas_agents():
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0")
    asyncio.run(collect(driver_with_info(prefill, decode), request()))
    assert decode.senders == [asyncio.run(prefill.ready()).kv_addresses] == [("mock://prefill-0",)]


def test_a_replica_without_info_is_reserved_with_no_senders():
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0")
    d = RequestDriver([Replica("prefill-0", "prefill", prefill)], [Replica("decode-0", "decode", decode)],
                      DriverSettings())
    asyncio.run(collect(d, request()))
    assert decode.senders == [()]


def test_metrics_export_the_replicas_dropped_kv_messages_bytes_preemptions_and_speculation():
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0")
    decode.kv_messages_dropped = MessageDrops(forged=3, oversized=1)
    decode.speculation = SpeculationStats("suffix", proposed=40, accepted=25, acceptance_counts=(3, 1, 0, 2, 4),
                                          declined_steps=7)
    prefill.kv_messages_by_reference = 30
    prefill.kv_bytes_sent, decode.kv_bytes_received, decode.num_preemptions = 4096, 4096, 2
    metrics = RouterMetrics(driver_with_info(prefill, decode), lambda: 0)

    async def scrape_twice() -> tuple[str, str]:
        first = metrics.exposition().decode()  # starts asking the replicas; shows what an earlier scrape brought
        await metrics.replica_counters.refreshing
        second = metrics.exposition().decode()
        await metrics.replica_counters.refreshing
        return first, second

    first, second = asyncio.run(scrape_twice())
    assert "tandem_kv_messages_dropped_total{" not in first
    assert 'tandem_kv_messages_dropped_total{pool="decode",reason="forged",replica="decode-0"} 3.0' in second
    assert 'tandem_kv_messages_dropped_total{pool="decode",reason="oversized",replica="decode-0"} 1.0' in second
    assert 'tandem_kv_messages_dropped_total{pool="prefill",reason="forged",replica="prefill-0"} 0.0' in second
    assert 'tandem_kv_messages_by_reference_total{pool="prefill",replica="prefill-0"} 30.0' in second
    assert 'tandem_kv_messages_by_reference_total{pool="decode",replica="decode-0"} 0.0' in second
    assert 'tandem_kv_transfer_bytes_total{direction="sent",pool="prefill",replica="prefill-0"} 4096.0' in second
    assert 'tandem_kv_transfer_bytes_total{direction="received",pool="decode",replica="decode-0"} 4096.0' in second
    assert 'tandem_num_preemptions_total{pool="decode",replica="decode-0"} 2.0' in second
    assert 'tandem_replica_prefix_hit_rate{pool="prefill",replica="prefill-0"} 0.0' in second
    labels = 'pool="decode",proposer="suffix",replica="decode-0"'
    assert f"tandem_speculative_proposed_tokens_total{{{labels}}} 40.0" in second
    assert f"tandem_speculative_accepted_tokens_total{{{labels}}} 25.0" in second
    assert f"tandem_speculative_declined_steps_total{{{labels}}} 7.0" in second
    assert f'tandem_speculative_acceptance_length_bucket{{le="1",{labels}}} 4.0' in second
    assert f'tandem_speculative_acceptance_length_bucket{{le="+Inf",{labels}}} 10.0' in second
    assert f"tandem_speculative_acceptance_length_count{{{labels}}} 10.0" in second
    assert 'proposer="suffix",replica="prefill-0"' not in second  # a replica that does not speculate
