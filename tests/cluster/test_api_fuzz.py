"""Both APIs fuzzed against a running colocated cluster of the embedded model (deploy/manifests/local-colocated.yaml
with one rank, API keys on, tight router.limits so that a valid request costs at most 4 new tokens):

  HTTP, schema-driven: schemathesis cases from the API's own OpenAPI document (build_app's app.openapi(), checked
      equal to the served /openapi.json), positive and negative, for every operation.
  HTTP, raw: whole requests from fuzz_strategies.http_raw (invalid UTF-8, NUL bytes, JSON nested 100,000 deep,
      unknown fields, huge arrays, huge / negative / non-finite / wrong-typed numbers, bodies cut short or over
      max_body_bytes, broken framing and keys) over plain sockets.
  gRPC, messages: tandem.v1 requests built from the proto's descriptors (fuzz_grpc.grpc_message).
  gRPC, raw: bytes that are no well-formed message (fuzz_grpc.grpc_raw) through a generic stub.

Every reply is checked: HTTP status < 500 (a 504 only for a body that asked for a shorter `timeout`, a 503 only
for honest overload), OpenAI's error object on every 4xx of an API route, well-formed 200s (a stream's error
events included); gRPC calls end OK or with a status naming the client's mistake, never INTERNAL or UNKNOWN
(RESOURCE_EXHAUSTED or UNAVAILABLE only for a message over the size limit or honest overload). Two clients that
stop sending mid-body are held open during the fuzz: the server must have let them go by request_timeout_s.
Afterwards no replica was restarted or lost, every KV block is free again and a greedy request gets the same
text over both APIs as before the fuzz.

Cases are drawn by Hypothesis with derandomize=True (the same cases every run) in a process of their own while
the cluster starts, and sent 12 at a time. TANDEM_FUZZ_REQUESTS (default 5200) sets how many requests the four
kinds share, for longer local runs: `TANDEM_FUZZ_REQUESTS=50000 pytest tests/cluster/test_api_fuzz.py -s` (-s
prints the figures: requests and statuses by kind and case, timings, and every kind of failure with requests).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from tandem.cluster.launcher import RunningCluster
from tandem.cluster.manifest import ApiKey, AuthSettings
from tandem.router.client import TandemClient
from tandem.router.limits import RequestLimits
from tests.cluster.fuzz_cases import MODEL, RawGrpc, RawHttp
from tests.cluster.fuzz_strategies import PARTS, draw, openapi_document
from tests.cluster.ray_cluster import chat, check_integrity, manifest_for_test, running, simulated_cluster, wait_idle

KEY = "sk-fuzz-test-0123456789"
LIMITS = RequestLimits(max_body_bytes=256 << 10, max_tokens=4, max_prompt_tokens=128, max_n=2, max_batch_prompts=2,
                       max_messages=8, max_stop_strings=4, max_stop_token_ids=8, max_top_logprobs=2)
REQUEST_TIMEOUT_S = 20.0
CLIENT_TIMEOUT_S = 45.0  # past the server's deadline: a reply that takes this long is a hang
WORKERS = 12
SHARES = {"http_schema": 0.40, "http_raw": 0.22, "grpc_message": 0.23, "grpc_raw": 0.15}
NORMAL = chat("What is the capital of France?")


# -- sending -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """One request's result: outcome is an HTTP status ("400"), a gRPC status name, or "no reply"; failure says
    what was wrong with it (None: nothing)."""

    kind: str
    case: object
    outcome: str
    failure: str | None
    seconds: float


@dataclass
class HttpReply:
    status: int | None = None
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None


def _dechunk(data: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        end = data.find(b"\r\n", i)
        if end < 0:
            return bytes(out)
        size = int(data[i:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        i = end + 2 + size + 2


def send_http(host: str, port: int, case: RawHttp) -> HttpReply:
    reply = HttpReply()
    with socket.create_connection((host, port), timeout=CLIENT_TIMEOUT_S) as sock:
        try:
            sock.sendall(case.data)
        except OSError as e:  # the server answered (413) and closed before taking everything
            reply.error = f"send: {e!r}"
        if case.close == "abort":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return HttpReply(error="aborted by us")
        if case.close == "half":
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        chunks = []
        try:
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
        except socket.timeout:
            return HttpReply(error="timeout")
        except OSError as e:
            reply.error = f"recv: {e!r}"
    raw = b"".join(chunks)
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        reply.error = reply.error or f"no reply ({len(raw)} bytes)"
        return reply
    lines = head.decode("latin-1").split("\r\n")
    reply.status = int(lines[0].split()[1])
    reply.headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    reply.body = _dechunk(body) if reply.headers.get("transfer-encoding") == "chunked" else body
    return reply


def overload(message: str) -> bool:
    """Whether an error says the cluster is honestly full (router/lifecycle.py NoCapacityError)."""
    return "has room" in message or "had room" in message


def _error_object(body: bytes) -> dict | None:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    ok = isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
    return error if ok else None


def _acceptable_error(error: dict | None, case: RawHttp, status: int) -> bool:
    """A 5xx (or a stream's error event, status 0) that is the honest answer."""
    if error is None:
        return False
    if error["type"] == "timeout_error":  # the deadline the body asked for
        return case.timeout_s is not None and case.timeout_s < REQUEST_TIMEOUT_S
    if error["type"] in ("service_unavailable_error", "rate_limit_error"):
        return overload(error["message"])
    return status < 500 and error["type"] != "internal_error"


def http_failure(case: RawHttp, reply: HttpReply) -> str | None:
    if reply.error == "timeout":
        return f"no reply within {CLIENT_TIMEOUT_S:g} s"
    if reply.status is None:
        if case.api and case.close == "read":
            return f"the connection closed without a reply ({reply.error})"
        return None
    error = _error_object(reply.body)
    if reply.status >= 500 and not _acceptable_error(error, case, reply.status):
        return f"HTTP {reply.status}: {reply.body[:500]!r}"
    if 400 <= reply.status < 500 and case.api and error is None:
        return f"HTTP {reply.status} without OpenAI's error object: {reply.body[:300]!r}"
    if reply.status == 200 and case.api and b"/v1/" in case.data.split(b"\r\n", 1)[0]:
        return _success_failure(case, reply)
    return None


def _success_failure(case: RawHttp, reply: HttpReply) -> str | None:
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in reply.body.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"a stream that does not end with [DONE]: {reply.body[-300:]!r}"
        for event in events[:-1]:
            error = _error_object(event.encode())
            if error is not None and not _acceptable_error(error, case, 0):
                return f"a stream that ends in an error: {event[:300]}"
        return None
    try:
        body = json.loads(reply.body)
    except ValueError:
        return f"a 200 that is not JSON: {reply.body[:300]!r}"
    if "choices" not in body and "data" not in body:
        return f"a 200 without choices: {reply.body[:300]!r}"
    return None


ALLOWED_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED}


def grpc_failure(code: grpc.StatusCode, details: str) -> str | None:
    if code in ALLOWED_GRPC:
        return None
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and ("larger than max" in details or overload(details)):
        return None
    if code == grpc.StatusCode.UNAVAILABLE and overload(details):
        return None
    return f"{code.name}: {details[:500]}"


_IDENTITY = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
_STREAMING = {"Generate"}


def send_grpc(channel: grpc.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    path = f"/tandem.v1.Tandem/{method}"
    metadata = (("authorization", f"Bearer {KEY}"),)
    try:
        if method in _STREAMING:
            for _ in channel.unary_stream(path, **_IDENTITY)(data, metadata=metadata, timeout=CLIENT_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path, **_IDENTITY)(data, metadata=metadata, timeout=CLIENT_TIMEOUT_S)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


class Sender:
    """Sends one case of any kind and judges its reply."""

    def __init__(self, http_endpoint: str, channel: grpc.Channel):
        host, _, port = http_endpoint.rpartition(":")
        self.host, self.port, self.channel = host, int(port), channel

    def __call__(self, item: tuple[str, object]) -> Outcome:
        kind, case = item
        start = time.monotonic()
        try:
            return self._send(kind, case, start)
        except Exception as e:  # a reply this client cannot even read
            return Outcome(kind, case, "unreadable", f"unreadable reply: {e!r}", time.monotonic() - start)

    def _send(self, kind: str, case: object, start: float) -> Outcome:
        if kind.startswith("http"):
            reply = send_http(self.host, self.port, case)
            outcome = str(reply.status) if reply.status is not None else "no reply"
            failure = http_failure(case, reply)
        else:
            method, data = (case.method, case.data) if isinstance(case, RawGrpc) else \
                (case[0], case[1].SerializeToString())
            code, details = send_grpc(self.channel, method, data)
            outcome, failure = code.name, grpc_failure(code, details)
        return Outcome(kind, case, outcome, failure, time.monotonic() - start)


# -- the cluster and the fuzz ------------------------------------------------------------------------------------

@dataclass
class Fuzz:
    """What the fuzz left for the tests to check: every outcome, and the cluster's state before it."""

    cluster: RunningCluster
    outcomes: list[Outcome]
    target: int
    before: dict
    replicas_before: dict
    timings: dict
    stalls: dict[str, str]


# Requests whose client stops sending mid-body and keeps the connection open; the server must give up on them.
STALLS = {"a body short of its Content-Length": b"Content-Length: 100\r\n\r\n{\"model\": ",
          "a chunked body cut inside a chunk": b"Transfer-Encoding: chunked\r\n\r\n40\r\n{\"model\": "}


def open_stalls(http_endpoint: str) -> list[tuple[str, socket.socket, float]]:
    host, _, port = http_endpoint.rpartition(":")
    stalls = []
    for name, tail in STALLS.items():
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\n" + tail)
        stalls.append((name, sock, time.monotonic()))
    return stalls


def stall_outcomes(stalls: list[tuple[str, socket.socket, float]]) -> dict[str, str]:
    """What became of each stalled request REQUEST_TIMEOUT_S + 10 s after it stalled: "closed", the reply's
    first line, or "still open"."""
    outcomes = {}
    for name, sock, opened in stalls:
        time.sleep(max(0.0, opened + REQUEST_TIMEOUT_S + 10 - time.monotonic()))
        sock.settimeout(0.5)
        try:
            data = sock.recv(1 << 16)
            outcomes[name] = data.split(b"\r\n", 1)[0].decode("latin-1") if data else "closed"
        except socket.timeout:
            outcomes[name] = "still open"
        except OSError:
            outcomes[name] = "closed"
        sock.close()
    return outcomes


def fuzz_manifest():
    """local-colocated.yaml with API keys, the test's limits and deadline, and one rank (pp=1): the fuzz aims
    at the front doors, and one rank starts in half the time on two cores."""
    manifest = manifest_for_test("local-colocated.yaml", auth=AuthSettings(api_keys=[ApiKey(tenant="fuzz", key=KEY)]))
    decode = manifest.pools.decode
    decode = decode.model_copy(update={"parallelism": decode.parallelism.model_copy(update={"pp": 1})})
    return manifest.model_copy(update={
        "pools": manifest.pools.model_copy(update={"decode": decode}),
        "router": manifest.router.model_copy(update={"limits": LIMITS, "request_timeout_s": REQUEST_TIMEOUT_S})})


def replica_identity(cluster) -> dict:
    """Each replica's state and rank processes: a restart changes them."""
    return {r["name"]: (r["state"], tuple(p["pid"] for p in r["rank_placements"]))
            for r in cluster.status()["replicas"]}


def normal_answers(cluster) -> dict:
    """A greedy chat over both APIs, within the test's limits."""
    reply = httpx.post(f"http://{cluster.http_endpoint}/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "messages": NORMAL, "max_tokens": 4, "temperature": 0})
    reply.raise_for_status()
    with TandemClient(cluster.endpoint, timeout_s=60, api_key=KEY) as client:
        via_grpc = client.generate(chat=NORMAL, max_tokens=4, temperature=0)
    return {"http": reply.json()["choices"][0]["message"]["content"], "grpc": via_grpc.text}


def report(fuzz: Fuzz) -> str:
    """The figures: requests and statuses by kind, timings, and every failure with its request."""
    lines = [f"requests: {len(fuzz.outcomes)} (target {fuzz.target})"]
    for kind in SHARES:
        mine = [o for o in fuzz.outcomes if o.kind == kind]
        statuses = Counter(o.outcome for o in mine)
        mean_ms = 1000 * sum(o.seconds for o in mine) / max(1, len(mine))
        lines.append(f"  {kind}: {len(mine)} (mean {mean_ms:.0f} ms); "
                     + ", ".join(f"{s} x{n}" for s, n in statuses.most_common()))
        by_case: dict[str, Counter] = {}
        for o in mine:
            by_case.setdefault(getattr(o.case, "kind", None) or o.case[0], Counter())[o.outcome] += 1
        lines += [f"      {name}: {sum(c.values())}; " + ", ".join(f"{s} x{n}" for s, n in c.most_common())
                  for name, c in sorted(by_case.items())]
    lines.append("timings: " + ", ".join(f"{k} {v:.1f}" for k, v in fuzz.timings.items()))
    slowest = max(fuzz.outcomes, key=lambda o: o.seconds)
    lines.append(f"slowest request: {slowest.seconds:.2f} s ({slowest.kind}, {slowest.outcome})")
    lines.append("stalled requests: " + ", ".join(f"{k}: {v}" for k, v in fuzz.stalls.items()))
    failures = [o for o in fuzz.outcomes if o.failure]
    lines.append(f"failures: {len(failures)}")
    by_cause: dict[str, list[Outcome]] = {}
    for o in failures:
        by_cause.setdefault(f"[{o.kind}] {o.failure[:70]}", []).append(o)
    for cause, mine in sorted(by_cause.items(), key=lambda item: -len(item[1])):
        lines.append(f"  {len(mine)} x {cause}")
        lines += [f"      {o.failure}\n      request: {describe(o.case)}" for o in mine[:3]]
    return "\n".join(lines)


def describe(case: object) -> str:
    if isinstance(case, RawHttp):
        return f"{case.kind} {len(case.data)} bytes: {case.data[:400]!r}"
    if isinstance(case, RawGrpc):
        return f"{case.kind} {case.method} {len(case.data)} bytes: {case.data[:200].hex()}"
    method, message = case
    return f"{method} {str(message)[:400]!r}"


@pytest.fixture(scope="module")
def fuzz():
    target = int(os.environ.get("TANDEM_FUZZ_REQUESTS", "5200"))
    counts = {kind: round(target * share) for kind, share in SHARES.items()}
    started = time.monotonic()
    # Drawn by a process of its own while the cluster starts (Hypothesis takes over `random` as it draws), cheap
    # parts first: each is sent as soon as it is drawn. Niced: the replica's start comes first.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=os.nice,
                             initargs=(19,)) as drawer:
        drawn = {part: drawer.submit(draw, part, counts[part.split(":")[0]] // (2 if ":" in part else 1), KEY,
                                     LIMITS.max_body_bytes) for part in PARTS}
        manifest = fuzz_manifest()
        with simulated_cluster({"decode": dict(num_cpus=2, resources={"decode": 4})}), running(manifest) as cluster:
            up = time.monotonic()
            served = httpx.get(f"http://{cluster.http_endpoint}/openapi.json", timeout=30).json()
            assert served == openapi_document(KEY), "the cluster serves another OpenAPI document than the one fuzzed"
            before = normal_answers(cluster)
            replicas_before = replica_identity(cluster)
            stalls = open_stalls(cluster.http_endpoint)
            first = time.monotonic()
            with grpc.insecure_channel(cluster.endpoint, options=[("grpc.max_send_message_length", -1),
                                                                  ("grpc.max_receive_message_length", -1)]) as channel:
                send = Sender(cluster.http_endpoint, channel)
                with ThreadPoolExecutor(WORKERS) as pool:
                    sent = []
                    for part in PARTS:  # in the order they are drawn, each shuffled
                        cases = drawn[part].result()
                        random.Random(11).shuffle(cases)
                        sent += [pool.submit(send, (part.split(":")[0], case)) for case in cases]
                    outcomes = [s.result() for s in sent]
            done = time.monotonic()
            stalled = stall_outcomes(stalls)
            timings = {"cluster start s": up - started, "fuzz s": done - first,
                       "requests/s": len(outcomes) / (done - first)}
            result = Fuzz(cluster, outcomes, target, before, replicas_before, timings, stalled)
            print("\n" + report(result))
            yield result


def test_the_fuzz_sent_the_requests_it_was_asked_for(fuzz):
    sent = Counter(o.kind for o in fuzz.outcomes)
    assert len(fuzz.outcomes) >= min(fuzz.target, 5000), sent
    assert all(sent[kind] for kind in SHARES), sent


def test_no_request_failed_inside_the_server(fuzz):
    failures = [o for o in fuzz.outcomes if o.failure]
    assert not failures, f"{len(failures)} of {len(fuzz.outcomes)}:\n" + "\n".join(
        f"[{o.kind}] {o.failure}\n    request: {describe(o.case)}" for o in failures[:10])


def test_a_client_that_stops_sending_its_body_is_cut_off(fuzz):
    held = [name for name, outcome in fuzz.stalls.items() if outcome == "still open"]
    assert not held, f"the server still waits, {REQUEST_TIMEOUT_S + 10:g} s on, for {', '.join(held)}"


def test_no_replica_was_restarted_or_lost(fuzz):
    status = fuzz.cluster.status()
    assert replica_identity(fuzz.cluster) == fuzz.replicas_before
    assert all(r["state"] == "ready" for r in status["replicas"])
    assert status["router"]["replicas_lost"] == []


def test_every_kv_block_is_free_again(fuzz):
    replicas = wait_idle(fuzz.cluster, timeout_s=20)
    assert all(r["kv_blocks_in_use"] == 0 for r in replicas)
    check_integrity(fuzz.cluster)


def test_a_normal_request_is_answered_as_before(fuzz):
    assert normal_answers(fuzz.cluster) == fuzz.before
    assert httpx.get(f"http://{fuzz.cluster.http_endpoint}/health", timeout=10).status_code == 200
