"""deploy/manifests/local.yaml (what `make run` starts) on a simulated multi-node Ray cluster: real Ray, real gRPC,
real UCX between a prefill and a decode replica on different nodes, each pinned to its own core, the embedded
model (the parallel layouts, local-parallel.yaml, run in test_openai_http.py). Outputs equal a
single-process run; streams are incremental and carry usage and timings; aborts and disconnects at every phase
leave no block held; bad requests get their status code and the cluster keeps serving."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from tandem.cluster.lora_settings import LoRASettings
from tandem.engine.core.generator import Generator
from tandem.engine.loader.lora_adapter import write_random_adapter
from tandem.engine.sampling_params import SamplingParams
from tandem.router.client import TandemClient, build_request
from tandem.router.limits import PriorityRange
from tests.cluster.ray_cluster import (QUESTIONS, chat, check_integrity, manifest_for_test, one_process_lora,
                                      running, simulated_cluster, wait_idle)
from tests.cluster.structured_checks import (greedy_reply_equals_one_process, sampled_replies_validate,
                                             tool_calls_round_trip)

MAX_TOKENS = 24


def forced_speculation(manifest):
    """local.yaml with its decode pool's speculation forced (adaptive: false): whether the cost model would let
    proposals pay depends on this machine's speed (an AVX2 CPU's steps priced them out), and the tests here check
    the speculated path against one process. The decision itself is tested in tests/engine/
    test_speculative_engine.py. The decode pool also preempts by priority (scheduler.preempt_after_s: 1 s)."""
    decode = manifest.pools.decode
    speculative = decode.engine.speculative.model_copy(update={"adaptive": False})
    engine = decode.engine.model_copy(update={"speculative": speculative})
    scheduler = decode.scheduler.model_copy(update={"preempt_after_s": PREEMPT_AFTER_S})
    return manifest.pools.model_copy(update={"decode": decode.model_copy(update={"engine": engine,
                                                                                 "scheduler": scheduler})})


PREEMPT_AFTER_S = 1.0


def with_priorities(manifest):
    """Requests without a key (the default tenant) may ask for priorities -5 to 5."""
    tenant = manifest.auth.default_tenant.model_copy(update={"priority": PriorityRange(min=-5, max=5)})
    return manifest.auth.model_copy(update={"default_tenant": tenant})


@pytest.fixture(scope="module")
def adapters(embedded, tmp_path_factory) -> dict[str, str]:
    """Three LoRA adapters of the embedded model (random weights, PEFT's format): two in the manifest, one loaded
    while the cluster runs."""
    root = tmp_path_factory.mktemp("lora")
    return {name: str(write_random_adapter(root / name, embedded.config, rank, seed=seed, scale=0.2))
            for name, rank, seed in (("terse", 8, 1), ("poet", 16, 2), ("late", 4, 3))}


@pytest.fixture(scope="module")
def cluster(adapters):
    manifest = manifest_for_test("local.yaml")
    lora = LoRASettings(adapters={name: adapters[name] for name in ("terse", "poet")}, max_rank=16, max_loaded=2,
                        runtime_loading=True)
    with simulated_cluster() as (ray_cluster, node_ids):
        with running(manifest.model_copy(update={"pools": forced_speculation(manifest), "lora": lora,
                                                 "auth": with_priorities(manifest)})) as tandem:
            tandem.node_ids = node_ids
            yield tandem


@pytest.fixture(scope="module")
def client(cluster):
    with TandemClient(cluster.endpoint, timeout_s=120) as c:
        yield c


def test_replicas_are_placed_on_the_nodes_offering_their_pool(cluster):
    status = cluster.status()
    by_name = {r["name"]: r for r in status["replicas"]}
    assert by_name["prefill-0"]["node_id"] == cluster.node_ids["prefill"]
    assert by_name["decode-0"]["node_id"] == cluster.node_ids["decode"]
    assert len(by_name["prefill-0"]["ranks"]) == 1 and len(by_name["decode-0"]["ranks"]) == 1
    # Each pool on its own core: the replica's process (its only rank) may run on that CPU alone.
    assert [list(p["cpus"]) for p in by_name["prefill-0"]["rank_placements"]] == [[0]]
    assert [list(p["cpus"]) for p in by_name["decode-0"]["rank_placements"]] == [[1]]
    assert all(r["state"] == "ready" for r in status["replicas"])


def test_concurrent_greedy_requests_equal_a_single_process_run(cluster, client, embedded):
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        results = list(pool.map(lambda q: client.generate(chat=chat(q), max_tokens=MAX_TOKENS, temperature=0),
                                QUESTIONS))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    with Generator(embedded) as reference:  # what `tandem generate` runs, in this process
        expected = [reference.generate(embedded.tokenizer.encode_chat(chat(q)), params) for q in QUESTIONS]
    for question, got, want in zip(QUESTIONS, results, expected):
        assert got.token_ids[0] == want.token_ids, question
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert (got.prefill_replica, got.decode_replica) == ("prefill-0", "decode-0")
        assert got.prefill_route == "prefill_pool"
        # usage and timings, on the last message
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert 0 < got.timings.ttft_s <= got.timings.e2e_s
        assert got.timings.prefill_s > 0 and got.timings.mean_itl_s > 0
        # the prefill replica's part of the transfer, then the decode replica's admission, within the prefill
        assert got.timings.transfer_s >= 0 and got.timings.admission_s > 0
        assert got.timings.transfer_s + got.timings.admission_s < got.timings.prefill_s
    wait_idle(cluster)
    check_integrity(cluster)


def test_the_stream_is_incremental(client):
    arrivals = []
    start = time.perf_counter()
    for message in client.stream(chat=chat("Count from one to twenty."), max_tokens=32, temperature=0,
                                 ignore_eos=True):
        arrivals.append((time.perf_counter() - start, len(message.token_ids)))
    token_messages = [t for t, n in arrivals if n]
    assert sum(n for _, n in arrivals) == 32
    assert len(token_messages) >= 8, "tokens should arrive over many messages, not in one at the end"
    # the first token arrived well before the last was generated
    assert token_messages[0] < 0.5 * token_messages[-1]


def test_cached_prefix_is_reported_from_the_prefill_replica(client):
    question = chat("Tell me a long story about a lighthouse keeper and the storm that changed everything.")
    first = client.generate(chat=question, max_tokens=2, temperature=0)
    second = client.generate(chat=question, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert second.usage.cached_tokens >= 16 * (second.usage.prompt_tokens // 16 - 1) > 0


def test_a_sessions_next_turn_pulls_the_last_answer_from_the_decode_replica(cluster, client, embedded):
    """The decode replica holds the first turn's prompt and answer; the prefill replica only the prompt. The next
    turn (prompt, answer, a new question) pulls the answer's blocks from the decode replica (router/prefix_pulls.py)
    instead of computing them: reported cached, and the reply is one process's."""
    first_ids = embedded.tokenizer.encode_chat(chat("Write a long poem about the sea and the lighthouses on it."))
    first = client.generate(token_ids=first_ids, max_tokens=96, temperature=0, ignore_eos=True)
    second_ids = first_ids + first.token_ids[0] + embedded.tokenizer.encode(" Now say it in one line.")
    wait_idle(cluster)
    time.sleep(0.5)  # the router's KV feed polls the replicas that just finished (about every 50 ms)
    second = client.generate(token_ids=second_ids, max_tokens=8, temperature=0)
    computed_by_decode = 16 * ((len(first_ids) + 96 - 1) // 16)  # the first turn's full blocks, answer included
    assert second.usage.cached_tokens >= computed_by_decode > 16 * (len(first_ids) // 16) + 4 * 16
    with Generator(embedded) as reference:
        expected = reference.generate(second_ids, SamplingParams(max_tokens=8, temperature=0))
    assert second.token_ids[0] == expected.token_ids
    wait_idle(cluster)
    check_integrity(cluster)


def test_logprobs_travel_with_every_token_including_the_prefilled_one(client):
    result = client.generate(prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
    logprobs = result.logprobs[0]
    assert [lp.token_id for lp in logprobs] == result.token_ids[0]
    for lp in logprobs:
        assert len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
        assert lp.top[0].token_id == lp.token_id and lp.logprob == pytest.approx(lp.top[0].logprob)  # greedy


def test_seeded_sampling_is_reproducible_across_the_transfer(client):
    kwargs = dict(chat=chat("Invent a name for a dragon."), max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    assert client.generate(**kwargs).token_ids == client.generate(**kwargs).token_ids


LONG_PROMPT = " ".join(f"Item {i} is a line in a long list that the model has to read." for i in range(60))


def _status_of(cluster, name):
    return next(r for r in cluster.status()["replicas"] if r["name"] == name)


def _wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("phase", ["reserved_prefilling", "decoding", "disconnect_decoding", "disconnect_prefilling"])
def test_abort_or_disconnect_at_each_phase_frees_every_block(cluster, client, phase):
    request_id = f"abort-{phase}"
    params = dict(max_tokens=400, temperature=0, ignore_eos=True)
    call = client.stub.Generate(build_request(prompt=LONG_PROMPT, request_id=request_id, **params))
    received = []
    reader = threading.Thread(target=_drain, args=(call, received), daemon=True)
    reader.start()
    if phase.endswith("prefilling"):
        # the decode replica holds the reservation while the prefill replica computes the prompt
        _wait_for(lambda: _status_of(cluster, "decode-0")["waiting_for_kv"] == 1)
    else:
        _wait_for(lambda: len(received) >= 3)
    if phase.startswith("disconnect"):
        call.cancel()
    else:
        assert client.abort(request_id)
    reader.join(30)
    assert not reader.is_alive()
    assert isinstance(received[-1], grpc.RpcError) and received[-1].code() is grpc.StatusCode.CANCELLED
    assert sum(len(m.token_ids) for m in received[:-1]) < 400
    replicas = wait_idle(cluster)
    assert all(r["kv_blocks_in_use"] == 0 for r in replicas)
    check_integrity(cluster)
    assert client.generate(prompt="The capital of France is", max_tokens=4, temperature=0).usage.completion_tokens == 4


def _fill_decode_kv(handle, prefix: str) -> list[str]:
    """Reserves every free block of the decode replica with transfers nobody sends (each lease runs 30 s);
    returns the reservation ids."""
    import ray

    held, sizes = [], [2000, 512, 128, 32, 8, 1]
    params = SamplingParams(max_tokens=1, temperature=0)
    for size in sizes:
        while ray.get(handle.reserve.remote(f"{prefix}-{len(held)}", [100 + len(held)] * size, params)) is not None:
            held.append(f"{prefix}-{len(held)}")
    return held


@pytest.mark.parametrize("how", ["abort", "disconnect"])
def test_abort_or_disconnect_while_queued_for_room(cluster, client, how):
    import ray

    decode = cluster.replica_handles()["decode-0"]
    held = _fill_decode_kv(decode, f"hog-{how}")
    try:
        assert _status_of(cluster, "decode-0")["waiting_for_kv"] == len(held) > 0
        request_id = f"queued-{how}"
        call = client.stub.Generate(build_request(prompt="Hello there", request_id=request_id, max_tokens=4))
        received = []
        reader = threading.Thread(target=_drain, args=(call, received), daemon=True)
        reader.start()
        _wait_for(lambda: cluster.status()["router"]["queued_requests"] == 1)
        if how == "abort":
            assert client.abort(request_id)
        else:
            call.cancel()
        reader.join(30)
        assert not reader.is_alive() and received[-1].code() is grpc.StatusCode.CANCELLED
        _wait_for(lambda: cluster.status()["router"]["queued_requests"] == 0)
        assert _status_of(cluster, "decode-0")["waiting_for_kv"] == len(held)  # nothing more was reserved
    finally:
        ray.get([decode.abort.remote(request_id) for request_id in held])
    wait_idle(cluster)
    check_integrity(cluster)


def test_a_request_of_higher_priority_waiting_for_decode_room_preempts_a_lower_one(cluster, client, embedded):
    """Issue 50 item 1 on the cluster: the decode replica's blocks are held (reservations nobody sends to) but for
    a low-priority request decoding and a little room; a high-priority request whose prompt does not fit waits in
    the router's decode room and, after the pool's preempt_after_s, its reservation preempts the low one. The high
    one ends first; the low one resumes (recomputed on the decode replica) with one process's greedy tokens."""
    import ray

    decode = cluster.replica_handles()["decode-0"]
    low_prompt, high_prompt = [100 + i % 500 for i in range(640)], [200 + i % 700 for i in range(720)]  # 40, 45 blocks
    low_params = dict(max_tokens=150, temperature=0, ignore_eos=True)
    before = _status_of(cluster, "decode-0")["num_preemptions"]
    call = client.stub.Generate(build_request(token_ids=low_prompt, request_id="low", priority=5, **low_params))
    received, ended = [], {}
    reader = threading.Thread(target=lambda: (_drain(call, received), ended.setdefault("low", time.monotonic())),
                              daemon=True)
    reader.start()
    _wait_for(lambda: len(received) >= 3)
    room = "hold-room"  # 32 blocks (of 16 tokens) held first and let go once the rest is held: < 45
    assert ray.get(decode.reserve.remote(room, [7] * 32 * 16, SamplingParams(max_tokens=1))) is not None
    held = _fill_decode_kv(decode, "hold")
    try:
        ray.get(decode.abort.remote(room))
        high = client.generate(token_ids=high_prompt, request_id="high", max_tokens=8, temperature=0, priority=-5)
        ended["high"] = time.monotonic()
        reader.join(120)
        assert not reader.is_alive() and not isinstance(received[-1], grpc.RpcError), received[-1]
    finally:
        ray.get([decode.abort.remote(request_id) for request_id in held])
    assert high.usage.completion_tokens == 8 and ended["high"] < ended["low"]
    assert high.timings.queue_s >= PREEMPT_AFTER_S  # it waited for room, then took it
    assert _status_of(cluster, "decode-0")["num_preemptions"] > before
    with Generator(embedded) as reference:
        want = reference.generate(low_prompt, SamplingParams(**low_params))
    assert [t for m in received for t in m.token_ids] == want.token_ids
    wait_idle(cluster)
    check_integrity(cluster)


def _drain(call, out: list) -> None:
    """Appends each message of the call as it arrives, then the RpcError that ended it, if any."""
    try:
        for message in call:
            out.append(message)
    except grpc.RpcError as e:
        out.append(e)


@pytest.mark.parametrize("kwargs, code, words", [
    (dict(prompt="Hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="Hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="Hi", logprobs=99), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (dict(prompt="Hi", stop_token_ids=[10 ** 9]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (dict(prompt="Hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
    (dict(prompt="word " * 3000), grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    (dict(prompt="Hi", max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    (dict(chat=[]), grpc.StatusCode.INVALID_ARGUMENT, "no messages"),
    (dict(chat=[{"role": "wizard", "content": "hi"}]), grpc.StatusCode.INVALID_ARGUMENT, "role"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    (dict(token_ids=[-5]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (dict(prompt="Hi", request_id="a/b"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
])
def test_invalid_requests_get_their_status_and_the_cluster_keeps_serving(client, kwargs, code, words):
    with pytest.raises(grpc.RpcError) as failure:
        client.generate(**kwargs)
    assert failure.value.code() is code
    assert words in failure.value.details()
    assert client.generate(prompt="The capital of France is", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_health_reflection_and_models(client):
    assert client.health() == "SERVING"
    assert client.health("tandem.v1.Tandem") == "SERVING"
    model, *adapters = client.list_models()  # the model, then the manifest's LoRA adapters
    assert (model.id, model.mode, model.max_model_len) == ("SmolLM2-135M-Instruct", "disaggregated", 2048)
    assert {a.id for a in adapters} >= {"poet", "terse"} and all(a.max_model_len == 2048 for a in adapters)
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    (response,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in response.list_services_response.service}
    assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= names


def test_status_json_and_generate_target_from_the_command_line(cluster):
    import json

    address = __import__("ray").get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "status", "--json", "--address", address],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["mode"] == "disaggregated" and report["endpoints"]["grpc"] == cluster.endpoint
    for replica in report["replicas"]:
        assert {"pool", "state", "running", "waiting", "kv_blocks_total", "kv_blocks_in_use"} <= set(replica)
    done = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "generate", "--target", cluster.endpoint,
                           "--prompt", "The capital of France is", "--max-tokens", "6", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["usage"]["completion_tokens"] == len(result["token_ids"]) == 6


def test_structured_output_holds_across_the_transfer(cluster, embedded):
    """The first token is sampled under the grammar on the prefill replica; the decode replica's matcher replays it
    and continues: the greedy reply equals one process's, sampled replies parse and validate, and tool calls
    round-trip through the openai client's types."""
    greedy_reply_equals_one_process(cluster.http_endpoint, embedded)
    sampled_replies_validate(cluster.http_endpoint)
    tool_calls_round_trip(cluster.http_endpoint)
    wait_idle(cluster)
    check_integrity(cluster)


def test_the_decode_replica_speculates_on_a_transferred_prompt_with_one_process_output(cluster, client, embedded):
    """local.yaml's decode pool speculates (the suffix proposer over the transferred prompt and the output; forced
    here, see forced_speculation): a reply that quotes its prompt equals one process's without speculation, and
    the decode replica's counters (in `tandem status`, as on /metrics) show accepted proposals; the prefill replica
    never speculates."""
    question = ("Repeat this sentence exactly, twice: The old lighthouse keeper climbed the stairs every evening "
                "to light the lamp for the ships.")
    before = {r["name"]: r.get("speculation") for r in wait_idle(cluster)}
    got = client.generate(chat=chat(question), max_tokens=48, temperature=0)
    with Generator(embedded) as reference:
        want = reference.generate(embedded.tokenizer.encode_chat(chat(question)),
                                  SamplingParams(max_tokens=48, temperature=0))
    assert got.token_ids[0] == want.token_ids and got.text == want.text
    after = {r["name"]: r.get("speculation") for r in wait_idle(cluster)}
    assert before["prefill-0"] is None and after["prefill-0"] is None
    assert after["decode-0"]["proposer"] == "suffix"
    accepted = after["decode-0"]["accepted"] - (before["decode-0"] or {}).get("accepted", 0)
    assert accepted > 0, after["decode-0"]
    check_integrity(cluster)


def test_lora_adapters_named_as_the_model_equal_one_process_across_the_transfer(cluster, client, embedded,
                                                                               adapters):
    """Requests of two manifest adapters and the base model at once (gRPC's model field), prefilled on one replica
    and decoded on the other: each equals one engine serving the same adapters, and the adapters change the
    output. Then an adapter loaded while the cluster runs (POST /v1/load_lora_adapter), listed in /v1/models and
    served by name over the OpenAI API, unloaded again (404 after). An unknown name is NOT_FOUND."""
    asks = [(q, adapter) for q in QUESTIONS[:3] for adapter in ("terse", "poet", None)]
    with ThreadPoolExecutor(len(asks)) as pool:
        results = list(pool.map(lambda ask: client.generate(chat=chat(ask[0]), max_tokens=MAX_TOKENS, temperature=0,
                                                            model=ask[1] or ""), asks))
    expected = one_process_lora(embedded, adapters, asks, MAX_TOKENS)
    for (question, adapter), got, want in zip(asks, results, expected):
        assert got.token_ids[0] == want, (question, adapter)
        assert (got.prefill_replica, got.decode_replica) == ("prefill-0", "decode-0")
    assert len({tuple(r.token_ids[0]) for r in results[:3]}) == 3  # each adapter answers differently
    with pytest.raises(grpc.RpcError) as refused:
        client.generate(chat=chat(QUESTIONS[0]), max_tokens=4, model="no-such-adapter")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "terse" in refused.value.details()

    http = f"http://{cluster.http_endpoint}/v1"
    loaded = httpx.post(f"{http}/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
    assert loaded.status_code == 200 and loaded.json()["replicas"] == ["decode-0", "prefill-0"], loaded.text
    models = [m["id"] for m in httpx.get(f"{http}/models").json()["data"]]
    assert models[1:] == ["late", "poet", "terse"] and models[0] != "late"
    reply = httpx.post(f"{http}/chat/completions", timeout=120, json={
        "model": "late", "messages": chat(QUESTIONS[4]), "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    want = one_process_lora(embedded, adapters, [(QUESTIONS[4], "late")], MAX_TOKENS)[0]
    assert reply["model"] == "late" and reply["usage"]["completion_tokens"] == len(want)
    assert reply["choices"][0]["message"]["content"] == embedded.tokenizer.decode(want, skip_special_tokens=True)
    bad = httpx.post(f"{http}/load_lora_adapter", json={"lora_name": "broken", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "adapter_config.json is missing" in bad.json()["error"]["message"]
    assert httpx.post(f"{http}/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    gone = httpx.post(f"{http}/chat/completions", json={"model": "late", "messages": chat("Hi"), "max_tokens": 2})
    assert gone.status_code == 404
    wait_idle(cluster)
    check_integrity(cluster)
