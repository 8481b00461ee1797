"""Requests that survive a dead replica (router/migration.py, driven by router/lifecycle.py) over mock replicas:
a decode replica that dies mid-stream hands the request to another by token replay (disaggregated and local
paths), the client's stream is the uninterrupted run's with no duplicated or missing token, max_migrations and
n > 1 end it UNAVAILABLE with the reason, and a prefill replica that dies is retried elsewhere or replaced by the
decode replica's own prefill, with its reservation aborted. Nothing stays held on any surviving replica."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.engine.core.resume import ResumeState
from tandem.engine.sampling_params import SamplingParams
from tandem.router.driver_settings import DriverSettings
from tandem.router.grpc_service import status_for
from tandem.router.lifecycle import Progress, RequestDriver
from tandem.router.migration import Replay, seeded
from tandem.router.mocks.batching import BatchedDecode, StepCosts
from tandem.router.mocks.replicas import DyingDecode, DyingPrefill, MockDecode, MockPrefill, token_for
from tandem.router.replicas import Replica, ReplicaLostError
from tandem.router.request_parsing import ParsedRequest
from tandem.router.run_key import RunKey
from tandem.router.serving import error_code

PROMPT = tuple(range(5, 45))  # 40 tokens: 2 full blocks and a partial one
MAX_TOKENS = 10
EXPECTED = [token_for(PROMPT, i) for i in range(MAX_TOKENS)]  # what an uninterrupted run streams


def request(request_id="r1", max_tokens=MAX_TOKENS, n=1, seed=None, temperature=0.0) -> ParsedRequest:
    return ParsedRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n,
                                                            seed=seed), 0)


def driver(prefill, decode, **settings) -> RequestDriver:
    return RequestDriver([Replica(p.name, "prefill", p) for p in prefill],
                         [Replica(d.name, "decode", d) for d in decode], DriverSettings(**settings))


async def collect(d: RequestDriver, req: ParsedRequest, seen: list[Progress] | None = None) -> list[Progress]:
    seen = [] if seen is None else seen
    async for p in d.run(req):
        seen.append(p)
    return seen


def tokens_of(progress: list[Progress], index: int = 0) -> list[int]:
    return [t for p in progress for o in p.outputs if o.index == index for t in o.token_ids]


def assert_nothing_held(d: RequestDriver, replicas) -> None:
    """Every surviving replica holds no block and runs nothing; the router's in-flight counters are back to 0."""
    async def stats():
        return [await r.stats() for r in replicas if not getattr(r, "dead", False)]

    for s in asyncio.run(stats()):
        assert (s.kv_blocks_in_use, s.running, s.waiting_for_kv) == (0, 0, 0), s
    assert all(r.load.in_flight == 0 for r in d.prefill + d.decode)
    assert all(not getattr(r, "reservations", None) for r in replicas)


# -- a decode replica dies mid-stream ----------------------------------------------------------------------------


def test_disaggregated_stream_moves_to_another_decode_replica_without_gap_or_duplicate():
    prefill, dying, healthy = MockPrefill("prefill-0"), DyingDecode("decode-0", after=3), MockDecode("decode-1")
    d = driver([prefill], [dying, healthy])
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED
    assert d.num_migrations == 1 and d.lost == ["decode-0"]
    assert healthy.served == ["r1.m1"]
    (rid, resume), = healthy.resumed
    assert resume.output_token_ids == tuple(EXPECTED[:3]) and resume.seed is not None  # the driver seeded it
    # the client sees its own id throughout, and one first progress (usage and timings are not reset)
    assert {o.request_id for p in progress for o in p.outputs} == {"r1"}
    assert [p.prefill_route for p in progress] == ["prefill_pool"] + [""] * (len(progress) - 1)
    assert progress[0].decode_replica == "decode-0"
    assert progress[-1].outputs[-1].finished and progress[-1].outputs[-1].num_prompt_tokens == len(PROMPT)
    assert "r1.m1" in healthy.aborted  # the end of the request reaches the replica it moved to
    assert_nothing_held(d, [prefill, dying, healthy])
    assert d.routing.decisions[("decode_replica", "migration")] == 1


def test_a_decode_replica_dead_before_its_first_token_is_replayed_from_nothing():
    """The prefill replica's first token is sampled again by the replay (the same for greedy and seeded)."""
    prefill, dying, healthy = MockPrefill("prefill-0"), DyingDecode("decode-0", after=0), MockDecode("decode-1")
    d = driver([prefill], [dying, healthy])
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED
    assert healthy.resumed[0][1].output_token_ids == ()
    # nothing had reached the client: the first progress it gets is a first one, naming where it decoded
    assert (progress[0].prefill_route, progress[0].decode_replica) == ("prefill_pool", "decode-1")
    assert_nothing_held(d, [prefill, dying, healthy])


def test_colocated_stream_moves_to_another_decode_replica():
    dying, healthy = DyingDecode("decode-0", after=4), MockDecode("decode-1")
    d = driver([], [dying, healthy], mode="colocated")
    progress = asyncio.run(collect(d, request(seed=5, temperature=0.8)))
    assert tokens_of(progress) == EXPECTED
    assert d.num_migrations == 1
    assert healthy.resumed == [("r1.m1", ResumeState(tuple(EXPECTED[:4]), 5))]  # the client's seed is kept
    assert progress[0].prefill_route == "colocated" and all(not p.prefill_route for p in progress[1:])
    assert_nothing_held(d, [dying, healthy])


def test_a_stream_moves_as_often_as_max_migrations_allows():
    decode = [DyingDecode(f"decode-{i}", after=2) for i in range(3)] + [MockDecode("decode-3")]
    d = driver([MockPrefill("prefill-0")], decode, max_migrations=3)
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED
    assert d.num_migrations == 3 and d.lost == ["decode-0", "decode-1", "decode-2"]
    assert [resume.output_token_ids for _, resume in decode[3].resumed] == [tuple(EXPECTED[:6])]
    assert decode[1].served == ["r1.m1"] and decode[2].served == ["r1.m2"] and decode[3].served == ["r1.m3"]
    assert_nothing_held(d, decode)


def test_past_max_migrations_the_request_is_unavailable_and_says_why():
    decode = [DyingDecode(f"decode-{i}", after=2) for i in range(4)]
    d = driver([MockPrefill("prefill-0")], decode, max_migrations=2)
    seen: list[Progress] = []
    with pytest.raises(ReplicaLostError, match=r"decode-2 died .*moved 2 times already \(max_migrations=2\)") as e:
        asyncio.run(collect(d, request(), seen))
    assert status_for(e.value)[0] is grpc.StatusCode.UNAVAILABLE and error_code(e.value)[0] == "UNAVAILABLE"
    assert tokens_of(seen) == EXPECTED[:6]  # 2 tokens from each of 3 replicas, none twice
    assert d.num_migrations == 2 and [r.name for r in d.decode] == ["decode-3"]
    assert_nothing_held(d, decode)


def test_with_no_decode_replica_left_the_request_is_unavailable_and_says_why():
    d = driver([MockPrefill("prefill-0")], [DyingDecode("decode-0", after=2), DyingDecode("decode-1", after=3)])
    seen: list[Progress] = []
    with pytest.raises(ReplicaLostError, match="decode-1 died .*no other decode replica is left"):
        asyncio.run(collect(d, request(), seen))
    assert tokens_of(seen) == EXPECTED[:5] and d.num_migrations == 1


def test_requests_with_n_above_1_are_not_migrated():
    dying, healthy = DyingDecode("decode-0", after=2), MockDecode("decode-1")
    d = driver([], [dying, healthy], mode="colocated")
    seen: list[Progress] = []
    with pytest.raises(ReplicaLostError, match=r"decode-0 died .*n > 1 is not migrated"):
        asyncio.run(collect(d, request(n=2), seen))
    assert d.num_migrations == 0 and healthy.resumed == [] and len(seen) == 2
    assert_nothing_held(d, [healthy])


def test_a_batching_replica_continues_a_migrated_stream():
    dying, batched = DyingDecode("decode-0", after=3), BatchedDecode("decode-1", StepCosts(step_s=0.001))
    d = driver([], [dying, batched], mode="colocated")
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED and batched.served == ["r1.m1"]
    assert_nothing_held(d, [batched])


def test_concurrent_streams_all_survive_their_replica():
    dying, healthy = DyingDecode("decode-0", after=2, step_s=0.001), MockDecode("decode-1", step_s=0.001)
    d = driver([MockPrefill("prefill-0")], [dying, healthy])

    async def many():
        return await asyncio.gather(*(collect(d, request(f"r{i}", seed=i)) for i in range(6)))

    for progress in asyncio.run(many()):
        assert tokens_of(progress) == EXPECTED
    assert d.num_migrations >= 1
    assert_nothing_held(d, [dying, healthy])


# -- a decode replica found dead while reserving -----------------------------------------------------------------


def test_a_decode_replica_found_dead_while_reserving_is_skipped():
    d = driver([MockPrefill("prefill-0")], [DyingDecode("decode-0", after=-1), MockDecode("decode-1")])
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED and progress[0].decode_replica == "decode-1"
    assert d.lost == ["decode-0"] and d.num_migrations == 0


# -- a prefill replica dies ------------------------------------------------------------------------------------


def test_a_dead_prefill_replica_is_retried_on_another_and_its_reservation_aborted():
    dying, healthy, decode = DyingPrefill("prefill-0"), MockPrefill("prefill-1"), MockDecode("decode-0")
    d = driver([dying, healthy], [decode])
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED
    assert dying.dead and d.lost == ["prefill-0"]
    assert healthy.prefilled == ["r1.p1"] and decode.served == ["r1", "r1.p1"]
    assert decode.aborted[0] == "r1"  # the first reservation was dropped at once
    assert (progress[0].prefill_replica, progress[0].prefill_route) == ("prefill-1", "prefill_pool")
    assert d.num_prefill_retries == 1 and d.routing.decisions[("prefill_pool", "prefill_replica_died")] == 1
    assert {o.request_id for p in progress for o in p.outputs} == {"r1"}
    assert_nothing_held(d, [healthy, decode])


def test_with_no_prefill_replica_left_the_decode_replica_prefills():
    dying, decode = DyingPrefill("prefill-0"), MockDecode("decode-0")
    d = driver([dying], [decode])
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED
    assert decode.served == ["r1", "r1.p1"] and decode.aborted[0] == "r1"
    assert progress[0].prefill_route == "prefill_replica_died"
    assert d.routing.decisions[("decode_replica", "prefill_replica_died")] == 1
    assert_nothing_held(d, [decode])


def test_a_dead_prefill_replica_past_max_migrations_is_unavailable_and_holds_nothing():
    dying, decode = DyingPrefill("prefill-0"), MockDecode("decode-0")
    d = driver([dying], [decode], max_migrations=0)
    with pytest.raises(ReplicaLostError, match=r"prefill-0 died .*max_migrations=0") as e:
        asyncio.run(collect(d, request()))
    assert status_for(e.value)[0] is grpc.StatusCode.UNAVAILABLE
    assert decode.reservations == {} and decode.aborted[0] == "r1"
    assert_nothing_held(d, [decode])


def test_a_decode_replica_that_dies_after_a_prefill_retry_still_migrates():
    """Moves of both kinds share one budget and one record of what the client has."""
    prefill = [DyingPrefill("prefill-0"), MockPrefill("prefill-1")]
    decode = [DyingDecode("decode-0", after=4), MockDecode("decode-1")]
    d = driver(prefill, decode)
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == EXPECTED
    assert decode[1].served == ["r1.m2"] and decode[1].resumed[0][1].output_token_ids == tuple(EXPECTED[:4])
    assert d.num_prefill_retries == 1 and d.num_migrations == 1
    assert_nothing_held(d, [prefill[1], decode[1]])


# -- the pieces ----------------------------------------------------------------------------------------------------


def test_seeded_gives_a_seed_only_to_unseeded_single_sample_requests():
    assert seeded(SamplingParams()).seed is not None
    assert seeded(SamplingParams(seed=3)).seed == 3
    assert seeded(SamplingParams(n=2)).seed is None


def test_replay_records_what_the_client_got_and_bounds_moves():
    from tandem.engine.core.output_processor import RequestOutput

    def out(rid, tokens, index=0, cached=0):
        return RequestOutput(rid, index, tuple(tokens), "", None, None, 4, cached, False)

    replay = Replay(RunKey("acme", "r", 3), max_moves=1)
    first = replay.forward([out("acme/r/3", [1, 2], cached=16), out("acme/r/3", [9], index=1)])
    assert [o.request_id for o in first] == ["r", "r"]  # reported under the client's id
    assert replay.next_key("m").replica_id() == "acme/r/3.m1" and not replay.can_move
    forwarded = replay.forward([out("acme/r/3.m1", [3], cached=32)])
    assert forwarded[0].request_id == "r" and forwarded[0].num_cached_tokens == 16  # usage does not change
    assert replay.resume_state(7) == ResumeState((1, 2, 3), 7)
    with pytest.raises(ValueError, match="no move left"):
        replay.next_key("m")


def test_a_replica_whose_engine_died_under_it_counts_as_dead():
    from ray.exceptions import RayActorError, RayTaskError

    from tandem.engine.errors import EngineDeadError, ReplicaFailedError
    from tandem.router.replicas import is_replica_death

    rank_killed = EngineDeadError("the engine failed: ReplicaFailedError('rank 1 (stage 1, ep 0, tp 0) is gone')")
    wrapped = RayTaskError("DecodeReplica.decode", "Traceback ...", rank_killed).as_instanceof_cause()
    assert is_replica_death(wrapped) and is_replica_death(rank_killed)
    assert is_replica_death(ReplicaFailedError("rank 0 exited")) and is_replica_death(RayActorError())
    assert not is_replica_death(ValueError("prompt too long"))
    assert not is_replica_death(RayTaskError("DecodeReplica.decode", "Traceback ...", ValueError("bad")))


def test_driver_settings_refuse_a_negative_max_migrations():
    with pytest.raises(ValueError, match="max_migrations"):
        DriverSettings(max_migrations=-1)


# -- over real decode replicas (colocated, in this process, on a tiny model) ---------------------------------------


class Killed:
    """A real decode replica whose actor 'dies' (RayActorError, as Ray reports it) after streaming `after` batches
    of a request; the request it was running is dropped there, as a dead actor's would be."""

    def __init__(self, replica, after: int):
        self.replica, self.after, self.dead = replica, after, False
        self.name = replica.name

    def __getattr__(self, name):
        return getattr(self.replica, name)

    async def generate(self, request_id, prompt_token_ids, params, *, priority=0, cache_salt=None, tenant=None,
                       trace=None):
        from ray.exceptions import RayActorError

        stream = self.replica.generate(request_id, prompt_token_ids, params, priority=priority,
                                       cache_salt=cache_salt, tenant=tenant, trace=trace)
        i = 0
        async for batch in stream:
            if i == self.after:
                self.dead = True
                await stream.aclose()  # the engine drops the request (its blocks go with the "dead" actor)
                raise RayActorError()
            i += 1
            yield batch


@pytest.fixture(scope="module")
def real_replicas(tiny_llama):
    from tandem.decode_worker.replica import DecodeReplica
    from tandem.engine.engine_config import EngineConfig
    from tandem.replica.spec import ReplicaSpec

    spec = ReplicaSpec(model=str(tiny_llama.source), device="cpu",
                       engine=EngineConfig(num_kv_blocks=48, max_model_len=256, check_integrity=True))
    replicas = [DecodeReplica(f"decode-{i}", spec, None) for i in range(2)]
    yield replicas
    for replica in replicas:
        asyncio.run(replica.shutdown())


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, presence_penalty=0.5,
                   frequency_penalty=0.5, repetition_penalty=1.2, ignore_eos=True),
], ids=["greedy", "seeded_with_penalties"])
def test_real_replicas_continue_a_stream_exactly(real_replicas, tiny_llama, params):
    prompt = tuple(tiny_llama.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then"))
    first, second = real_replicas

    def run(decode: list, request_id: str) -> list[Progress]:
        d = driver([], decode, mode="colocated")
        return asyncio.run(collect(d, ParsedRequest(request_id, prompt, params, 0))), d

    tag = "greedy" if params.greedy else "seeded"  # ids are remembered once aborted: one pair per case
    whole, _ = run([second], f"whole-{tag}")
    killed = Killed(first, after=5)
    moved, d = run([killed, second], f"moved-{tag}")
    assert killed.dead and d.num_migrations == 1
    assert tokens_of(moved) == tokens_of(whole) and len(tokens_of(whole)) == 20
    assert "".join(o.text for p in moved for o in p.outputs) == "".join(o.text for p in whole for o in p.outputs)
    assert moved[-1].outputs[-1].finish_reason == whole[-1].outputs[-1].finish_reason == "length"
    assert {o.request_id for p in moved for o in p.outputs} == {f"moved-{tag}"}
    assert all(o.num_prompt_tokens == len(prompt) for p in moved for o in p.outputs)

    async def stats():
        return [await r.stats() for r in real_replicas]

    assert all((s.kv_blocks_in_use, s.running, s.waiting) == (0, 0, 0) for s in asyncio.run(stats()))
