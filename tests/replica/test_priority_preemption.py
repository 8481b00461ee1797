"""Priority preemption end to end in one process: the router's request driver over a real decode replica (its
engine on the tiny model, one sequence at a time, `scheduler: {policy: priority, preempt_after_s}`), as a
colocated cluster runs them. A high-priority request arriving while a low-priority one decodes waits
preempt_after_s, preempts it, finishes first, and the low one ends with the tokens it gives alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.decode_worker.replica import DecodeReplica
from tandem.engine.engine_config import EngineConfig, SchedulingConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.replica.spec import ReplicaSpec
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ParsedRequest

PREEMPT_AFTER_S = 0.02


@pytest.fixture(scope="module")
def replica(tiny_llama):
    engine = EngineConfig(num_kv_blocks=64, max_model_len=256, max_num_seqs=1,
                          scheduling=SchedulingConfig(policy="priority", preempt_after_s=PREEMPT_AFTER_S))
    built = DecodeReplica("decode-0", ReplicaSpec(model=str(tiny_llama.source), device="cpu", engine=engine), None)
    yield built
    asyncio.run(built.shutdown())


def request(rid: str, prompt: list[int], max_tokens: int, priority: int) -> ParsedRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, seed=7)
    return ParsedRequest(rid, tuple(prompt), params, priority, tenant="acme")


async def tokens(driver: RequestDriver, parsed: ParsedRequest, ended: list[str]) -> list[int]:
    out = [t async for progress in driver.run(parsed) for o in progress.outputs for t in o.token_ids]
    ended.append(parsed.request_id)
    return out


def test_a_high_priority_request_preempts_a_low_one_and_both_give_their_own_tokens(replica):
    driver = RequestDriver([], [Replica("decode-0", "decode", replica)], DriverSettings(mode="colocated"))
    low, high = list(range(5, 45)), list(range(60, 80))

    async def main():
        ended: list[str] = []
        low_task = asyncio.create_task(tokens(driver, request("low", low, 200, priority=5), ended))
        while (await replica.stats()).running == 0:
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        high_tokens = await tokens(driver, request("high", high, 6, priority=0), ended)
        high_s = time.monotonic() - sent
        low_tokens = await low_task
        alone = await tokens(driver, request("low-alone", low, 200, priority=5), ended)
        return ended, high_tokens, high_s, low_tokens, alone

    ended, high_tokens, high_s, low_tokens, alone = asyncio.run(main())
    assert ended[:2] == ["high", "low"]  # the high one did not wait for the low one's 200 tokens
    assert len(high_tokens) == 6 and high_s >= PREEMPT_AFTER_S
    assert low_tokens == alone and len(alone) == 200
    assert asyncio.run(replica.stats()).num_preemptions == 1
