"""The router's side of LoRA adapters (router/lora_routes.py, request_parsing.py): the OpenAI `model` field names
an adapter or is NOT_FOUND; a replica is loaded with an adapter right before it first serves one of its requests;
loads and unloads reach every replica, and a refusal names the replica and its reason."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.kv.prefix_cache import kv_salt
from tandem.engine.loader import load_model
from tandem.engine.sampling_params import SamplingParams
from tandem.router.client import build_request
from tandem.router.lora_routes import LoRARoutes, UnknownAdapter
from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tandem.router.replicas import Replica, ReplicaPools
from tandem.router.request_parsing import InvalidRequest, ModelFacts, parse_request

MODEL_ID = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    loaded = load_model(None, weights=False, progress=False)
    routes = LoRARoutes({"sql": "/adapters/sql"})
    return ModelFacts(MODEL_ID, loaded.tokenizer, loaded.config.vocab_size, 2048, lora=routes)


def test_the_model_field_names_the_base_model_or_an_adapter(facts):
    assert parse_request(build_request(prompt="hi", model=MODEL_ID), facts).params.lora is None
    assert parse_request(build_request(prompt="hi"), facts).params.lora is None
    parsed = parse_request(build_request(prompt="hi", model="sql"), facts)
    assert parsed.params.lora == "sql"
    # the adapter salts the request's block hashes, as the replicas' do
    assert parsed.hash_salt == kv_salt(None, "sql") != kv_salt(None, None)
    with pytest.raises(InvalidRequest, match="'nope' is not served here.*LoRA adapters sql") as refused:
        parse_request(build_request(prompt="hi", model="nope"), facts)
    assert refused.value.code == "NOT_FOUND"


def _pools() -> tuple[ReplicaPools, MockPrefill, MockDecode]:
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0")
    decode.lora_adapters["sql"] = "/adapters/sql"  # started with the manifest's adapter
    replicas = [Replica("prefill-0", "prefill", prefill), Replica("decode-0", "decode", decode)]
    replicas[1].info = asyncio.run(decode.ready())
    return ReplicaPools(replicas[:1], replicas[1:]), prefill, decode


def test_a_replica_without_the_adapter_loads_it_before_its_first_request():
    pools, prefill, decode = _pools()
    routes = pools.adapters
    assert routes.holders == {"sql": {"decode-0"}}
    routes.paths["sql"] = "/adapters/sql"
    params = SamplingParams(max_tokens=2, lora="sql")

    async def run() -> None:
        await pools["decode-0"].api.reserve("r1", [1, 2, 3], params)  # holds it already: nothing loaded
        assert routes.loads_on_demand == 0
        descriptor = await pools["decode-0"].api.reserve("r2", [1, 2, 3], params)
        await pools["prefill-0"].api.prefill("r2", [1, 2, 3], params, descriptor)
        assert prefill.lora_adapters == {"sql": "/adapters/sql"} and routes.loads_on_demand == 1
        await pools["prefill-0"].api.prefill("r3", [1, 2, 3], SamplingParams(max_tokens=2), descriptor)
        assert routes.loads_on_demand == 1  # base-model requests load nothing
        with pytest.raises(UnknownAdapter):
            await pools["prefill-0"].api.prefill("r4", [1, 2, 3], SamplingParams(lora="gone"), descriptor)

    asyncio.run(run())
    assert routes.holders["sql"] == {"decode-0", "prefill-0"}
    pools.remove("prefill-0")
    assert routes.holders["sql"] == {"decode-0"}


def test_loads_and_unloads_reach_every_replica_and_a_refusal_says_where():
    pools, prefill, decode = _pools()
    routes = pools.adapters

    async def run() -> None:
        assert set(await routes.load("chat", "/adapters/chat", pools.all())) == {"prefill-0", "decode-0"}
        assert prefill.lora_adapters["chat"] == decode.lora_adapters["chat"] == "/adapters/chat"
        with pytest.raises(ValueError, match="could not be loaded on prefill-0: a LoRA adapter needs a name and a path"):
            await routes.load("empty", "", pools.all()[:1])
        await routes.unload("chat", pools.all())
        assert "chat" not in prefill.lora_adapters and "chat" not in decode.lora_adapters
        with pytest.raises(UnknownAdapter):
            await routes.unload("chat", pools.all())

    asyncio.run(run())
    assert routes.names == ("sql",)


def test_routing_prefers_the_replicas_that_serve_the_adapter():
    pools, _, _ = _pools()
    pools.add(Replica("decode-1", "decode", MockDecode("decode-1")))
    base_prefill, base_decode = pools.loads(None)
    assert [r.name for r in base_decode] == ["decode-0", "decode-1"]
    prefill, decode = pools.loads("sql")
    assert [r.name for r in decode] == ["decode-0"]  # decode-1 would load it first
    assert [r.name for r in prefill] == ["prefill-0"]  # no prefill replica serves it yet: all of them
