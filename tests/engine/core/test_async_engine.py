"""The async API and abort paths, on a tiny random model so that a thousand requests take seconds."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.engine.core.async_engine import AsyncEngine
from tandem.engine.core.llm_engine import LLMEngine, RequestRejectedError
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams

from tests.engine.engine_helpers import run_all


def make(loaded, **config) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**({"num_kv_blocks": 96, "max_model_len": 256, "block_size": 16} | config)))


def test_stream_delivers_text_deltas_tokens_and_usage(embedded):
    prompt = embedded.tokenizer.encode("The capital of France is")
    reference = make(embedded)
    reference.add_request("x", prompt, SamplingParams(max_tokens=12, temperature=0))
    expected = run_all(reference)[("x", 0)]
    engine = make(embedded)

    async def main():
        async with AsyncEngine(engine) as server:
            outputs = [o async for o in server.generate("a", prompt, SamplingParams(max_tokens=12, temperature=0))]
            return outputs, server.stats()

    outputs, stats = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason in ("stop", "length")
    assert [t for o in outputs for t in o.token_ids] == expected.token_ids
    assert "".join(o.text for o in outputs) == expected.text
    assert all(o.num_prompt_tokens == len(prompt) for o in outputs)
    assert stats.num_blocks_in_use == 0 and stats.num_running == 0


def test_bad_requests_fail_at_once_and_others_keep_streaming(tiny_llama):
    async def main():
        async with AsyncEngine(make(tiny_llama)) as server:
            good = asyncio.create_task(_collect(server.generate("good", [5, 6, 7], SamplingParams(max_tokens=20))))
            with pytest.raises(RequestRejectedError, match="maximum context length"):
                async for _ in server.generate("long", [5] * 250, SamplingParams(max_tokens=10)):
                    pass
            with pytest.raises(ValueError, match="outside the vocabulary"):
                async for _ in server.generate("oov", [10**7], SamplingParams()):
                    pass
            outputs = await good
            return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) >= 1


async def _collect(stream):
    return [o async for o in stream]


@pytest.mark.parametrize("phase", ["waiting", "mid-prefill", "decoding"])
def test_abort_in_each_phase_frees_every_block_at_once(tiny_llama, phase):
    engine = make(tiny_llama, max_num_batched_tokens=32, max_num_seqs=3)
    engine.add_request("blocker-1", list(range(5, 25)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("blocker-2", list(range(5, 25)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("victim", list(range(100, 190)), SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    if phase == "waiting":
        engine.step()
        assert engine.scheduler.seqs["victim#0"].status.value == "waiting"
    else:
        engine.abort_request("blocker-2")  # make room: the victim starts on the next step
        engine.step()
        victim = engine.scheduler.seqs["victim#0"]
        assert victim.status.value == "running" and victim.is_prefilling
        if phase == "decoding":
            while engine.scheduler.seqs["victim#0"].is_prefilling:
                engine.step()
            engine.step()
            assert engine.kv_manager.block_table("victim#1")  # the fork holds blocks too
    held = engine.stats().num_blocks_in_use
    outputs = engine.abort_request("victim")
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    engine.check_integrity()
    assert not engine.kv_manager.block_table("victim#0") and not engine.kv_manager.block_table("victim#1")
    if phase != "waiting":
        assert engine.stats().num_blocks_in_use < held
    run_all(engine)
    assert engine.stats().num_blocks_in_use == 0


def test_thousand_request_soak_with_random_aborts_ends_with_no_blocks_in_use(tiny_llama):
    rng = random.Random(7)
    engine = make(tiny_llama, num_kv_blocks=64, max_num_seqs=48, max_num_batched_tokens=256, check_integrity=True)

    async def client(server: AsyncEngine, i: int, counts: dict) -> None:
        prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0, 0.8]),
                                n=rng.choice([1, 1, 1, 2]), ignore_eos=True)
        mode = rng.random()
        stream = server.generate(f"q{i}", prompt, params, priority=rng.randint(0, 2))
        got = 0
        async for output in stream:
            got += 1
            if mode < 0.15 and got >= 1:
                counts["aborted"] += 1
                await server.abort(f"q{i}")
                break
            if mode < 0.3 and got >= 2:
                counts["abandoned"] += 1
                break  # leaving the stream aborts the request
        else:
            counts["completed"] += 1

    async def main():
        counts = {"aborted": 0, "abandoned": 0, "completed": 0}
        async with AsyncEngine(engine) as server:
            for wave in range(10):
                await asyncio.gather(*(client(server, wave * 100 + i, counts) for i in range(100)))
            await asyncio.sleep(0.05)
            return counts, server.stats()

    counts, stats = asyncio.run(main())
    assert sum(counts.values()) == 1000 and counts["aborted"] > 50 and counts["completed"] > 500
    engine.check_integrity()
    assert engine.stats().num_blocks_in_use == 0 and not engine.has_unfinished_requests()
    assert stats.num_preemptions > 0  # the small pool forced some


def test_stop_ends_open_streams_as_aborted_and_frees_their_blocks(tiny_llama):
    engine = make(tiny_llama)

    async def main():
        server = AsyncEngine(engine)
        server.start()
        stream = server.generate("long", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await stream.__anext__()
        await server.stop()
        rest = [o async for o in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert first.token_ids and rest[-1].finish_reason == "abort" and rest[-1].finished
    assert engine.stats().num_blocks_in_use == 0


def test_an_engine_failure_reaches_every_stream_and_refuses_new_requests(tiny_llama):
    from tandem.engine.core.async_engine import EngineDeadError

    engine = make(tiny_llama)

    def broken(_schedule):
        raise RuntimeError("device lost")

    engine.executor.execute_step = broken

    async def main():
        async with AsyncEngine(engine) as server:
            with pytest.raises(EngineDeadError, match="device lost"):
                async for _ in server.generate("a", [5, 6], SamplingParams(max_tokens=4)):
                    pass
            with pytest.raises(EngineDeadError, match="device lost"):
                server.add_request("b", [5, 6], SamplingParams(max_tokens=4))

    asyncio.run(main())


def test_call_runs_on_the_engine_thread_returns_and_raises(tiny_llama):
    import threading

    async def main():
        async with AsyncEngine(make(tiny_llama)) as server:
            name = await server.call(lambda engine: threading.current_thread().name)
            with pytest.raises(ValueError, match="already in use"):
                await server.call(lambda engine: (engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2)),
                                                  engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))))
            await server.abort("dup")
            return name, await server.call(lambda engine: engine.stats())

    name, stats = asyncio.run(asyncio.wait_for(main(), 30))
    assert name == "tandem-engine"
    assert stats.num_blocks_in_use == 0


def test_batches_group_what_arrived_and_tick_keeps_the_loop_polling(tiny_llama):
    ticks = []

    async def main():
        server = AsyncEngine(make(tiny_llama), tick=lambda: ticks.append(1) or len(ticks) < 50)
        async with server:
            stream = server.add_request("a", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
            deadline = asyncio.get_running_loop().time() + 20
            while len(ticks) < 50:  # the loop polls on after the request's 12 steps: its outputs pile up unread
                assert asyncio.get_running_loop().time() < deadline, f"{len(ticks)} ticks"
                await asyncio.sleep(0.01)
            return [batch async for batch in server.batches("a", stream)]

    batches = asyncio.run(asyncio.wait_for(main(), 30))
    assert sum(len(b) for b in batches) == 12 and batches[-1][-1].finished
    assert len(batches) < 12  # outputs that arrived together came as one batch
    assert len(ticks) >= 50  # ticked every iteration while it asked to, not only on commands
