"""bench/quantization.py's pieces on a small scale: the transfer measurement moves what the KV formats say, and
greedy agreement counts leading tokens (the full run is `bench/quantization.py`, docs/BENCHMARKS.md)."""

from __future__ import annotations

from tandem.bench.quantization import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, agreement, transfer_times
from tandem.kv_transfer.descriptor import KVFormat


def test_transfers_move_the_senders_format_and_take_time():
    found = transfer_times([("bfloat16", "int8"), ("int8", "int8")], tokens=40, rounds=1, requests=2)
    blocks = -(-40 // BLOCK)
    for pair, sender in (("bfloat16->int8", "bfloat16"), ("int8->int8", "int8")):
        fmt = KVFormat(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, sender)
        assert found[pair]["bytes"] == LAYERS * KV_HEADS * blocks * fmt.bytes_per_block_layer_head
        assert found[pair]["seconds"] > 0


def test_agreement_counts_leading_equal_tokens():
    assert agreement([[1, 2, 3], [4, 5], [6]], [[1, 2, 9], [4, 5], [7, 8]]) == [2, 2, 0]
