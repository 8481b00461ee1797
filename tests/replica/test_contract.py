"""The router/replica contract (replica/contract.py) holds on every side: the worker actors, the Ray adapters the
router and controller call them through, and the mock replicas all offer each Protocol method with the same
parameters and the same sync/async/streaming kind, and the router's side of it imports no torch."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import typing

import pytest

from tandem.replica import contract
from tandem.replica.remote import RemoteDecodeReplica, RemotePrefillReplica, remote_replica
from tandem.router.mocks.replicas import MockDecode, MockPrefill


def _protocol_methods(protocol) -> dict[str, typing.Callable]:
    names = {n for klass in protocol.__mro__ if klass not in (object, typing.Protocol, typing.Generic)
             for n, v in vars(klass).items() if callable(v) and not n.startswith("_")}
    return {n: getattr(protocol, n) for n in sorted(names)}


def _kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "stream"
    if inspect.iscoroutinefunction(fn):
        return "async"
    return "sync"


def _params(fn) -> list[tuple[str, object]]:
    """Ray's tracing adds a keyword-only _ray_trace_ctx to the methods of a class once ray.remote() saw it."""
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values() if p.name != "_ray_trace_ctx"]


def _implementations():
    import ray

    from tandem.decode_worker.replica import DecodeReplica
    from tandem.prefill_worker.replica import PrefillReplica

    for actor_class in (PrefillReplica, DecodeReplica):  # as the controller starts them (Ray wraps the methods)
        ray.remote(actor_class)

    return [(contract.PrefillReplicaAPI, PrefillReplica), (contract.PrefillReplicaAPI, RemotePrefillReplica),
            (contract.PrefillReplicaAPI, MockPrefill), (contract.DecodeReplicaAPI, DecodeReplica),
            (contract.DecodeReplicaAPI, RemoteDecodeReplica), (contract.DecodeReplicaAPI, MockDecode)]


@pytest.mark.parametrize("protocol,implementation", _implementations(),
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_every_side_offers_the_protocol(protocol, implementation):
    for name, declared in _protocol_methods(protocol).items():
        offered = getattr(implementation, name, None)
        assert offered is not None, f"{implementation.__name__} lacks {name}"
        assert _params(offered) == _params(declared), f"{implementation.__name__}.{name} takes other parameters"
        # A stream is declared as a plain def returning an AsyncIterator; the actors and mocks are async
        # generators, and the Ray adapter returns one.
        if "AsyncIterator" in str(inspect.signature(declared).return_annotation):
            assert _kind(offered) in ("stream", "sync"), f"{implementation.__name__}.{name} must stream"
        else:
            assert _kind(offered) == "async", f"{implementation.__name__}.{name} must be a coroutine"


def test_the_protocols_cover_what_the_router_calls():
    every = {"ready", "stats", "health", "kv_events", "abort", "check_integrity", "shutdown", "reserve_prefix",
             "send_prefix", "keep_prefix", "load_lora", "unload_lora"}
    assert set(_protocol_methods(contract.PrefillReplicaAPI)) == every | {"prefill"}
    assert set(_protocol_methods(contract.DecodeReplicaAPI)) == every | {"reserve", "decode", "generate", "resume"}


def test_remote_replica_picks_the_pools_adapter():
    assert isinstance(remote_replica("prefill", object()), RemotePrefillReplica)
    assert isinstance(remote_replica("decode", object()), RemoteDecodeReplica)
    with pytest.raises(ValueError, match="unknown pool 'router'"):
        remote_replica("router", object())


def test_values_crossing_the_seam_are_frozen_dataclasses():
    import dataclasses

    for value in (contract.ReplicaInfo, contract.ReplicaStats, contract.KVEventsReply, contract.PrefillResult,
                  contract.ReadyReplica):
        assert dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen, value.__name__


def test_the_router_imports_no_torch():
    """DESIGN.md: the router needs the tokenizer and the model's config, never the runtime; it reads them with the
    torch-free loader. The replica actor classes' modules are here too: Ray imports an actor's class module in
    every process that receives its handle (to read its methods), so the router imports them when the control
    plane hands it the replicas (importing torch there cost a replacement router seconds before it served)."""
    modules = ["tandem.router.serving", "tandem.router.lifecycle", "tandem.router.replicas",
               "tandem.router.http_service", "tandem.router.grpc_service", "tandem.router.router_actor",
               "tandem.router.mocks.replicas", "tandem.replica.contract", "tandem.replica.remote",
               "tandem.prefill_worker.replica", "tandem.decode_worker.replica"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "from tandem.router.router_actor import RouterActor\n"
            + "from tandem.router.driver_settings import DriverSettings\n"
            + "actor = RouterActor(None, DriverSettings())\n"
            + "assert actor.config.vocab_size == actor.tokenizer.vocab_size, actor.config\n"
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


class _Recorder:
    """Stands in for a decode replica: each streaming method records how it was called and yields one batch."""

    def __getattr__(self, name):
        async def method(*args, **kwargs):
            yield [(name, args, kwargs)]

        return method


def test_each_stream_call_opens_the_method_it_stands_for_with_every_field():
    """What crosses the token channel (and the Ray streaming call) is a typed StreamCall, never a method name:
    each opens its Protocol method by reference, passing every field."""
    from tandem.engine.core.resume import ResumeState
    from tandem.engine.sampled_token import SampledToken
    from tandem.engine.sampling_params import SamplingParams
    from tandem.replica.shell import ReplicaShell

    params, token = SamplingParams(max_tokens=3), SampledToken(7, None, ())
    resume = ResumeState(output_token_ids=(1, 2), seed=3)
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    calls = [(contract.DecodeCall("a", token, trace), ("decode", ("a", token), {"trace": trace})),
             (contract.GenerateCall("b", [1], params, 2, "salt", trace, "acme"),
              ("generate", ("b", [1], params), {"priority": 2, "cache_salt": "salt", "tenant": "acme",
                                                "trace": trace})),
             (contract.ResumeCall("c", [1], params, resume, -1, None),
              ("resume", ("c", [1], params, resume), {"priority": -1, "cache_salt": None, "tenant": None,
                                                      "trace": None}))]
    assert set(contract.STREAM_CALLS) == {type(call) for call, _ in calls}
    assert set(_protocol_methods(contract.DecodeReplicaAPI)) >= {name for _, (name, _, _) in calls}

    async def first(stream):
        return [batch async for batch in stream][0][0]

    decode = type("Decode", (_Recorder,), {"streams": contract.STREAM_CALLS, "pool": "decode"})()
    prefill = type("Prefill", (_Recorder,), {"streams": (), "pool": "prefill"})()
    for call, expected in calls:
        assert asyncio.run(first(call.open(_Recorder()))) == expected
        assert asyncio.run(first(ReplicaShell.stream(decode, call))) == expected
        with pytest.raises(TypeError, match=f"a prefill replica runs no {type(call).__name__} stream"):
            asyncio.run(first(ReplicaShell.stream(prefill, call)))
