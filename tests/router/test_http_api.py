"""The OpenAI-compatible HTTP API (router/http_service.py) over the mock engine: a real uvicorn server on a free
loopback port, driven by the official `openai` client and by httpx. Covers the reply shapes, n, batched prompts,
logprobs, usage, errors mapped to HTTP statuses with OpenAI error bodies, API keys, a client that goes away,
an error after the first token, and /health and /metrics. (tests/cluster/test_openai_http.py runs the same client
against a real cluster and the real model.)"""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import httpx
import openai
import pytest

from tandem.engine.loader import load_model
from tandem.router.auth import Authenticator
from tandem.router.http_service import build_app, start_http_server
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ModelFacts
from tandem.router.serving import Serving
from tandem.router.mocks.replicas import DyingDecode, MockDecode, MockPrefill, token_for

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"sk-acme-0123456789": "acme", "sk-beta-0123456789": "beta"}


class Server:
    """The router's serving core with mock replicas, its HTTP app on a background event loop."""

    def __init__(self, decode, prefill=(), settings: DriverSettings = DriverSettings(), keys=None, tokenizer=None):
        self.prefill, self.decode = list(prefill), list(decode)
        loaded = embedded()
        facts = ModelFacts(MODEL, tokenizer or loaded.tokenizer, loaded.config.vocab_size, 512)
        self.tokenizer = tokenizer or loaded.tokenizer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def boot():
            driver = RequestDriver([Replica(p.name, "prefill", p) for p in self.prefill],
                                   [Replica(d.name, "decode", d) for d in self.decode], settings)
            self.serving = Serving(driver, facts, settings.mode, auth=Authenticator(keys))
            return await start_http_server(build_app(self.serving), "127.0.0.1:0")

        self.http, port = asyncio.run_coroutine_threadsafe(boot(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{port}"

    def client(self, key: str | None = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.http.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def httpx_error(url: str, headers: dict) -> None:
    """GET /v1/models with headers; raises the openai client's error for a 401."""
    response = httpx.get(f"{url}/v1/models", headers=headers)
    if response.status_code == 401:
        raise openai.AuthenticationError(response.json()["error"]["message"], response=response, body=None)


@functools.lru_cache(maxsize=1)
def embedded():
    return load_model(None, weights=False, progress=False)


@pytest.fixture
def server():
    s = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")])
    yield s
    s.close()


def fake_text(prompt_ids, n_tokens, k=0) -> str:
    return "".join(f"<{token_for(tuple(prompt_ids), i) + k}>" for i in range(n_tokens))


def test_chat_non_streaming_and_streaming_agree(server):
    c = server.client()
    messages = [{"role": "user", "content": "Hello there"}]
    prompt_ids = server.tokenizer.encode_chat(messages)
    reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == fake_text(prompt_ids, 4)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 4)

    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second time, the prefix is cached


def test_completions_with_n_batched_prompts_and_logprobs(server):
    c = server.client()
    reply = c.completions.create(model=MODEL, prompt=["one two", "three four five"], max_tokens=3, n=2,
                                 temperature=0.7, seed=5, logprobs=2)
    assert [ch.index for ch in reply.choices] == [0, 1, 2, 3]  # prompt i's samples are i*n .. i*n+n-1
    first_prompt = server.tokenizer.encode("one two")
    assert reply.choices[1].text == fake_text(first_prompt, 3, k=1)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(alternatives) <= 2 for alternatives in lp.top_logprobs) and lp.text_offset[0] == 0
    assert reply.usage.completion_tokens == 4 * 3


def test_chat_logprobs_carry_the_token_and_alternatives(server):
    reply = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)


@pytest.mark.parametrize("kwargs, status, needle", [
    ({"temperature": -1.0}, 400, "temperature"),
    ({"max_tokens": 100_000}, 400, "maximum context length"),
    ({"extra_body": {"frobnicate": 1}}, 400, "Unrecognized request argument supplied: frobnicate"),
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, 400, "needs a chat template"),
    ({"extra_body": {"logit_bias": {"1": 5}}}, 400, "not supported"),
    ({"model": "gpt-4"}, 404, "is not served here"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, kwargs, status, needle):
    c = server.client()
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | kwargs
    with pytest.raises(openai.APIStatusError) as caught:
        c.chat.completions.create(**args)
    assert caught.value.status_code == status and needle in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"
    assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=2).choices[0].finish_reason == "length"


def test_malformed_json_is_a_400(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_no_room_is_429_and_no_replica_is_503():
    full = Server([MockDecode("decode-0", room=[False] * 10_000)], [MockPrefill("prefill-0")],
                  DriverSettings(queue_timeout_s=0.05))
    try:
        with pytest.raises(openai.RateLimitError, match="no decode replica had room"):
            full.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        full.serving.driver.remove("decode-0")
        with pytest.raises(openai.InternalServerError) as caught:
            full.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert caught.value.status_code == 503
        assert httpx.get(f"{full.url}/health").status_code == 503
    finally:
        full.close()


def test_api_keys_gate_the_api_but_not_health_and_metrics():
    s = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")], keys=KEYS)
    try:
        with pytest.raises(openai.AuthenticationError, match="invalid API key") as caught:
            s.client("sk-wrong-0123456789").models.list()
        assert caught.value.status_code == 401
        with pytest.raises(openai.AuthenticationError, match="expected `Bearer <key>`"):
            httpx_error(s.url, {"Authorization": "Basic abc"})
        response = httpx.get(f"{s.url}/v1/models")
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"
        assert [m.id for m in s.client("sk-acme-0123456789").models.list()] == [MODEL]
        assert httpx.get(f"{s.url}/health").status_code == 200
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'tandem_auth_failures_total{api="http"} 3.0' in metrics  # wrong, malformed, missing
    finally:
        s.close()


def test_tenants_get_their_own_prefix_cache():
    prefill = MockPrefill("prefill-0")
    s = Server([MockDecode("decode-0")], [prefill], keys=KEYS)
    try:
        prompt = "word " * 80  # several full blocks
        usage = []
        for key in ("sk-acme-0123456789", "sk-acme-0123456789", "sk-beta-0123456789"):
            reply = s.client(key).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            usage.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert usage[0] == 0 and usage[1] > 0 and usage[2] == 0
    finally:
        s.close()


def test_a_client_that_goes_away_aborts_its_request_on_the_replicas():
    decode = MockDecode("decode-0", step_s=0.05)
    s = Server([decode], [MockPrefill("prefill-0")])
    try:
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
        assert '"text"' in first
        deadline = time.monotonic() + 5
        while not (decode.aborted and not s.serving.active):  # the router forgets it a few loop turns after
            assert time.monotonic() < deadline, (decode.aborted, s.serving.active)
            time.sleep(0.02)
    finally:
        s.close()


def test_a_non_streaming_client_that_goes_away_aborts_its_request_too():
    decode = MockDecode("decode-0", step_s=0.05)
    s = Server([decode], [MockPrefill("prefill-0")])
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", timeout=0.5,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 200})  # would take 10 s
        deadline = time.monotonic() + 5
        while not (decode.aborted and not s.serving.active):  # the router forgets it a few loop turns after
            assert time.monotonic() < deadline, (decode.aborted, s.serving.active)
            time.sleep(0.02)
        # and the server serves the next request as usual
        assert s.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
    finally:
        s.close()


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event():
    s = Server([DyingDecode("decode-0", after=2)], [MockPrefill("prefill-0")])
    try:
        stream = s.client().completions.create(model=MODEL, prompt="Hi", max_tokens=10, stream=True)
        with pytest.raises(openai.APIError, match="died"):
            for _ in stream:
                pass
    finally:
        s.close()


def test_metrics_count_requests_routing_decisions_and_latencies(server):
    c = server.client()
    c.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=-2)
    text = httpx.get(f"{server.url}/metrics").text
    assert 'tandem_requests_total{api="http",code="OK"} 1.0' in text
    assert 'tandem_requests_total{api="http",code="INVALID_ARGUMENT"} 1.0' in text
    assert 'tandem_prefill_decisions_total{reason="prefill_pool",where="prefill_pool"} 1.0' in text
    assert "tandem_time_to_first_token_seconds_count 1.0" in text
    assert "tandem_routing_decision_seconds_count" in text and 'tandem_replicas{pool="decode"} 1.0' in text
    # where the time of the one that ran went, and its prompt's cache lookups, by the pool that prefilled it
    for family in ("tandem_time_per_output_token_seconds", "tandem_request_decode_time_seconds",
                   "tandem_kv_transfer_seconds"):
        assert f"{family}_count 1.0" in text, family
    for family in ("tandem_request_prefill_time_seconds", "tandem_request_queue_seconds"):
        assert f'{family}_count{{pool="prefill"}} 1.0' in text, family
    assert 'tandem_request_queue_seconds_count{pool="decode"} 1.0' in text
    prompt = next(line for line in text.splitlines() if line.startswith("tandem_prompt_tokens_total "))
    assert f'tandem_prefix_cache_queries_total{{pool="prefill"}} {prompt.split()[1]}' in text
    assert 'tandem_prefix_cache_hits_total{pool="prefill"}' in text


def test_lora_adapters_load_only_where_the_manifest_allows_and_are_served_by_name():
    """Runtime loading off: 403. On with API keys: only an admin tenant; then every replica has the adapter,
    /v1/models lists it, a request names it and the reply does too; unloading an unknown one is 404."""
    closed = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")])
    try:
        refused = httpx.post(f"{closed.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert refused.status_code == 403 and "lora.runtime_loading" in refused.json()["error"]["message"]
    finally:
        closed.close()
    settings = DriverSettings(lora_runtime_loading=True, lora_admin_tenants=("acme",))
    s = Server([MockDecode("decode-0")], [MockPrefill("prefill-0")], settings=settings, keys=KEYS)
    try:
        def post(path, key, body):
            return httpx.post(f"{s.url}/v1/{path}", json=body, headers={"authorization": f"Bearer {key}"})

        body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        assert post("load_lora_adapter", "sk-beta-0123456789", body).status_code == 403  # not an admin tenant
        assert post("load_lora_adapter", "sk-acme-0123456789", {"lora_name": "sql"}).status_code == 400
        loaded = post("load_lora_adapter", "sk-acme-0123456789", body)
        assert loaded.status_code == 200 and loaded.json()["replicas"] == ["decode-0", "prefill-0"]
        assert all(r.lora_adapters == {"sql": "/adapters/sql"} for r in s.prefill + s.decode)
        models = s.client("sk-beta-0123456789").models.list()
        assert [m.id for m in models.data] == [MODEL, "sql"]
        reply = s.client("sk-beta-0123456789").completions.create(model="sql", prompt="hi", max_tokens=3)
        assert reply.model == "sql" and reply.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError):
            s.client("sk-beta-0123456789").completions.create(model="nope", prompt="hi", max_tokens=3)
        assert post("unload_lora_adapter", "sk-acme-0123456789", {"lora_name": "nope"}).status_code == 404
        assert post("unload_lora_adapter", "sk-acme-0123456789", {"lora_name": "sql"}).status_code == 200
        assert all(not r.lora_adapters for r in s.prefill + s.decode)
    finally:
        s.close()
