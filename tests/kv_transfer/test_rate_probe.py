"""The KV transfer rate probe (kv_transfer/rate_probe.py): real agents in two spawned processes over UCX on loopback
measure a rate that is the bytes they moved over the time it took, on the path the config gives; a config the
agents cannot start with, a receiver that cannot start and a probe past its time end in an error that says what
failed, with no process of the probe left behind."""

from __future__ import annotations

import time

import psutil
import pytest

from tandem.kv_transfer import shm
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat
from tandem.kv_transfer.rate_probe import measure_transfer_rate

KV = KVFormat(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
SMALL = dict(tokens=40, requests=2, rounds=3)  # 3 blocks a request


def _probe_processes() -> set[int]:
    """This process's spawned children (the resource tracker, which multiprocessing keeps, is not one)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def leaves_no_process():
    before = _probe_processes()
    yield
    assert _probe_processes() <= before


@pytest.mark.parametrize("shared_memory", [False, True], ids=["transport", "shared-memory"])
def test_the_rate_is_the_bytes_moved_over_the_median_round(shared_memory, leaves_no_process):
    start = time.monotonic()
    rate = measure_transfer_rate(KV, TransferConfig(shared_memory=shared_memory), **SMALL)
    took = time.monotonic() - start
    # Every request's 3 whole blocks, K and V of 4 layers x 2 KV heads x 16 rows x 32 float32s.
    assert rate.payload_bytes == 2 * 3 * 4 * 2 * (2 * 16 * 32 * 4)
    assert 0 < rate.seconds < took and rate.bytes_per_s == pytest.approx(rate.payload_bytes / rate.seconds)
    assert rate.seconds_per_token == pytest.approx(rate.seconds / 80)
    # Shared memory is taken where this host offers it (Linux x86-64), the transport otherwise.
    assert rate.path == ("shared memory" if shared_memory and shm.domain() else "transport")
    assert f"({rate.path}): 2 requests x 40 tokens" in rate.describe()
    assert (rate.requests, rate.tokens, rate.rounds) == (2, 40, 3)


def test_a_config_the_agents_cannot_start_with_is_an_error_naming_it(leaves_no_process):
    broken = TransferConfig(ucx_env={"UCX_TLS": "no_such_transport"})
    with pytest.raises(RuntimeError, match=r"KV transfer probe failed: (sender|receiver).*cannot start a UCX "
                                           r"listener"):
        measure_transfer_rate(KV, broken, **SMALL)


def test_a_receiver_that_cannot_start_is_an_error_naming_the_receiver(leaves_no_process):
    nowhere = max(psutil.Process().cpu_affinity()) + 1000
    with pytest.raises(RuntimeError, match=f"failed: receiver: cannot start: ValueError: CPU\\(s\\) {nowhere} are "
                                           "not offered"):
        measure_transfer_rate(KV, TransferConfig(), receiver_cpus=(nowhere,), **SMALL)


def test_a_probe_past_its_time_is_stopped(leaves_no_process):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no result in 0.5 s \(receiver running, sender running\); stopped"):
        measure_transfer_rate(KV, TransferConfig(), timeout_s=0.5, **SMALL)
    assert time.monotonic() - start < 5


def test_counts_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        measure_transfer_rate(KV, TransferConfig(), tokens=0)
