"""The other two example manifests on a simulated multi-node Ray cluster: local-colocated.yaml (one replica that
prefills and decodes, behind the same router) and local-moe.yaml (a generated Mixtral-layout model, decode split
ep=2 x pp=2). Greedy outputs equal a single-process run of the same model, over gRPC and (colocated) the OpenAI
HTTP API; the colocated cluster streams over the replica's token channel, the MoE one over Ray streaming calls
(router.token_channel: false)."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import h11
import httpx
import openai

from tandem.cluster.cli import main as tandem_main
from tandem.cluster.lora_settings import LoRASettings
from tandem.cluster.manifest_yaml import parse_manifest
from tandem.engine.core.generator import Generator
from tandem.engine.loader import load_model
from tandem.engine.loader.lora_adapter import write_random_adapter
from tandem.engine.sampling_params import SamplingParams
from tandem.router.client import TandemClient
from tests.cluster.ray_cluster import (MANIFESTS, QUESTIONS, chat, check_integrity, manifest_for_test,
                                      one_process_lora, running, simulated_cluster, wait_idle)
from tests.cluster.structured_checks import greedy_reply_equals_one_process


def run_concurrently(endpoint: str, max_tokens: int):
    with TandemClient(endpoint, timeout_s=180) as client, ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(lambda q: client.generate(chat=chat(q), max_tokens=max_tokens, temperature=0),
                             QUESTIONS))


def single_process(loaded, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    with Generator(loaded) as reference:
        return [reference.generate(loaded.tokenizer.encode_chat(chat(q)), params) for q in QUESTIONS]


def draft_manifest():
    """local-colocated.yaml with its pool speculating by a draft model, as a manifest says it: `speculative:
    {proposer: draft, draft: self, adaptive: false}` (the embedded model's own GGUF weights, run 4-bit; adaptive
    off so that it proposes whatever this machine's speed, as in test_disaggregated's forced_speculation)."""
    text = (MANIFESTS / "local-colocated.yaml").read_text()
    asked = "speculative: {proposer: draft, draft: self, max_tokens: 4, adaptive: false}"
    drafted = text.replace("speculative: {proposer: suffix, max_tokens: 4}", asked)
    assert drafted != text
    manifest = manifest_for_test("local-colocated.yaml")
    return manifest.model_copy(update={"pools": parse_manifest(drafted).pools})


BURST_TOKENS = 8


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


async def post_once(http_endpoint: str, path: str, payload: dict) -> tuple[float, Reply]:
    """One POST on its own connection, parsed by h11: (seconds from connecting to the whole reply, the reply).
    Plain asyncio streams, so that the client's own cost stays small next to the server's: an httpx client
    took 1.1-1.3 s to send 400 requests to a server that only answered 429 on a 2-core machine, this 0.25 s."""
    host, port = http_endpoint.rsplit(":", 1)
    sent = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        connection = h11.Connection(h11.CLIENT)
        body = json.dumps(payload).encode()
        headers = [("host", http_endpoint), ("content-type", "application/json"), ("content-length", str(len(body))),
                   ("connection", "close")]
        writer.write(connection.send(h11.Request(method="POST", target=path, headers=headers))
                     + connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage()))
        status, reply_headers, chunks = 0, {}, []
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                reply_headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return time.monotonic() - sent, Reply(status, reply_headers, b"".join(chunks))
    finally:
        writer.close()


def burst(http_endpoint: str, count: int) -> list[tuple[float, Reply]]:
    """count chat requests sent at once, each on its own connection: (seconds to its reply, the reply)."""
    async def run() -> list[tuple[float, Reply]]:
        return await asyncio.gather(*(post_once(http_endpoint, "/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct", "messages": chat(f"Tell me a story, number {i}."),
            "max_tokens": BURST_TOKENS, "ignore_eos": True}) for i in range(count)))

    return asyncio.run(run())


def test_colocated_mode_serves_through_the_same_router(embedded, tmp_path):
    nodes = {"decode": dict(num_cpus=2, resources={"decode": 4})}
    tone = str(write_random_adapter(tmp_path / "tone", embedded.config, 8, seed=5, scale=0.2))
    manifest = draft_manifest().model_copy(update={"lora": LoRASettings(adapters={"tone": tone}, max_rank=8)})
    with simulated_cluster(nodes) as (_, node_ids), running(manifest) as cluster:
        status = cluster.status()
        assert [r["name"] for r in status["replicas"]] == ["decode-0"]
        assert status["replicas"][0]["node_id"] == node_ids["decode"]
        results = run_concurrently(cluster.endpoint, 16)
        for got, want in zip(results, single_process(embedded, 16)):
            assert got.token_ids[0] == want.token_ids  # the draft's proposals changed nothing
            assert (got.prefill_replica, got.decode_replica) == ("", "decode-0")
            assert got.usage.completion_tokens == len(want.token_ids)
        speculation = wait_idle(cluster)[0]["speculation"]
        assert speculation["proposer"] == "draft" and speculation["accepted"] > 0, speculation
        with TandemClient(cluster.endpoint) as client:
            model, adapter = client.list_models()
            assert model.mode == adapter.mode == "colocated" and adapter.id == "tone"
            stream = client.stream(prompt="Once upon a time", max_tokens=200, temperature=0, ignore_eos=True)
            next(stream), next(stream)
            stream.close()  # a client that goes away mid-decode
        # The OpenAI API on the colocated cluster: the same greedy text, prefilled on the decode replica.
        openai_client = openai.OpenAI(base_url=f"http://{cluster.http_endpoint}/v1", api_key="none", max_retries=0,
                                      timeout=120)
        reply = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat(QUESTIONS[0]),
                                                      max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == results[0].text
        greedy_reply_equals_one_process(cluster.http_endpoint, embedded)  # structured output, colocated
        # A LoRA adapter on the colocated replica, drafted by the base model's 4-bit twin: one process's tokens.
        adapted = openai_client.chat.completions.create(model="tone", messages=chat(QUESTIONS[1]), max_tokens=16,
                                                        temperature=0)
        want = one_process_lora(embedded, {"tone": tone}, [(QUESTIONS[1], "tone")], 16)[0]
        assert adapted.model == "tone" and adapted.usage.completion_tokens == len(want)
        assert adapted.choices[0].message.content == embedded.tokenizer.decode(want, skip_special_tokens=True)
        metrics = httpx.get(f"http://{cluster.http_endpoint}/metrics").text
        assert 'tandem_prefill_decisions_total{reason="colocated",where="decode_replica"}' in metrics
        # A real burst (issue 48): 400 chat requests at once over HTTP, after a first burst measured the start
        # rate. Every refusal comes within 2 s of its request, with Retry-After; every admitted request completes.
        burst(cluster.http_endpoint, 100)
        results = burst(cluster.http_endpoint, 400)
        refused = [(seconds, reply) for seconds, reply in results if reply.status_code == 429]
        admitted = [reply for _, reply in results if reply.status_code == 200]
        assert refused and admitted and len(refused) + len(admitted) == 400, {r.status_code for _, r in results}
        assert max(seconds for seconds, _ in refused) < 2.0, sorted(seconds for seconds, _ in refused)[-5:]
        assert all(int(reply.headers["retry-after"]) >= 1 for _, reply in refused)
        assert all(reply.json()["usage"]["completion_tokens"] == BURST_TOKENS for reply in admitted)
        wait_idle(cluster)
        check_integrity(cluster)
        # the streams went over the replica's token channel (a batch carries every output since the last one):
        # at least one frame for each admitted request (refused ones open no stream; a slow machine refuses more)
        assert cluster.status()["replicas"][0]["stream_frames"] >= len(admitted)


def test_moe_manifest_with_expert_and_pipeline_parallel_decode(tmp_path):
    folder = tmp_path / "tiny-moe"
    assert tandem_main(["make-model", "tiny-moe", str(folder)]) == 0
    loaded = load_model(folder, progress=False)
    assert loaded.config.num_experts == 8
    manifest = manifest_for_test("local-moe.yaml", model=str(folder))
    # this cluster streams over Ray calls (the token channel's fallback), the colocated one above over the channel
    manifest = manifest.model_copy(update={"router": manifest.router.model_copy(update={"token_channel": False})})
    with simulated_cluster() as _, running(manifest) as cluster:
        decode = next(r for r in cluster.status()["replicas"] if r["name"] == "decode-0")
        assert len(decode["ranks"]) == 4  # ep=2 x pp=2
        results = run_concurrently(cluster.endpoint, 12)
        for question, got, want in zip(QUESTIONS, results, single_process(loaded, 12)):
            assert got.token_ids[0] == want.token_ids, question
            assert (got.prefill_replica, got.decode_replica) == ("prefill-0", "decode-0")
        wait_idle(cluster)
        check_integrity(cluster)
        assert next(r for r in cluster.status()["replicas"] if r["name"] == "decode-0")["stream_frames"] == 0


def test_make_model_is_deterministic(tmp_path):
    for name in ("a", "b"):
        assert tandem_main(["make-model", "tiny-moe", str(tmp_path / name)]) == 0
    for file in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()
