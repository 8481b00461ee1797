"""The control plane on a real cluster of the embedded model (deploy/manifests/local-failover.yaml on the simulated
multi-node Ray cluster: one prefill replica, two decode replicas): `tandem scale` grows and drains a pool while it
serves, a dead replica is detected, leaves routing and is replaced, and faults are injected while requests run: a
decode rank SIGKILLed mid-stream (its streams continue on the other decode replica by replay), a prefill rank
SIGKILLed mid-prefill and a dropped KV transfer connection (the prompt is prefilled again), and a killed router
(replaced on the same ports). Every request in flight ends with the tokens of an uninterrupted run and every
surviving replica holds no block. One cluster for the whole module (a replica takes half a minute to start on two
cores)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import ray

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.client import TandemClient
from tests.cluster.ray_cluster import manifest_for_test, running, simulated_cluster, wait_idle

NODES = {"prefill": dict(num_cpus=2, resources={"prefill": 4}),
         "decode": dict(num_cpus=3, resources={"decode": 6})}  # room for three decode replicas of two ranks


RESOURCE_TIMEOUT_S = 8.0
PREFILL_CHUNK = 256


def failover_manifest():
    """local-failover.yaml on free ports, with a short wait for resources (the shortfall test) and prefill in
    chunks of PREFILL_CHUNK tokens (a long prompt's transfer then spans engine steps, so a drill can reach it)."""
    manifest = manifest_for_test("local-failover.yaml")
    decode, prefill = manifest.pools.decode, manifest.pools.prefill
    autoscaling = decode.autoscaling.model_copy(update={"resource_timeout_s": RESOURCE_TIMEOUT_S})
    engine = prefill.engine.model_copy(update={"max_num_batched_tokens": PREFILL_CHUNK})
    pools = manifest.pools.model_copy(update={"decode": decode.model_copy(update={"autoscaling": autoscaling}),
                                              "prefill": prefill.model_copy(update={"engine": engine})})
    return manifest.model_copy(update={"pools": pools})


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(NODES), running(failover_manifest()) as running_cluster:
        yield running_cluster


def wait_for(cluster, check, timeout_s: float, what: str) -> dict:
    """Polls the cluster's status until check(status) holds; returns that status."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster.status()
        if check(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:g} s; last status: {status['pools']} "
                                 f"{[(r['name'], r['state']) for r in status['replicas']]}")
        time.sleep(0.5)


def ask(cluster, question: str = "What is the capital of France?", max_tokens: int = 8):
    with TandemClient(cluster.endpoint, timeout_s=120) as client:
        return client.generate(chat=[{"role": "user", "content": question}], max_tokens=max_tokens,
                               temperature=0)


def metric(cluster, name: str, **labels) -> float | None:
    text = httpx.get(f"http://{cluster.http_endpoint}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}}" if want else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_scale_pins_a_pool_and_grows_it(cluster):
    status = cluster.status()
    assert status["pools"]["decode"]["autoscaling"] and status["pools"]["decode"]["desired"] == 2
    assert "pinned at 3" in cluster.scale("decode", 3)
    status = cluster.status()
    assert status["pools"]["decode"]["pinned"] == 3 and status["pools"]["decode"]["pending"] == 1
    status = wait_for(cluster, lambda s: s["pools"]["decode"]["ready"] == 3, 180, "a third decode replica")
    assert status["pools"]["decode"]["last_decision"]["reason"] == "pinned by `tandem scale`"
    assert ask(cluster).usage.completion_tokens == 8
    assert wait_for_metric(cluster, "tandem_pool_replicas", 3, pool="decode", state="desired")


def test_a_pool_asks_ray_for_resources_and_reports_a_shortfall_when_none_come(cluster):
    """The decode node has room for three decode replicas; a fourth asks Ray's autoscaler for its bundle (no
    autoscaler runs here, so nothing comes), is given up after resource_timeout_s, and the pool keeps serving
    with what it has and asks for no more."""
    wait_for(cluster, lambda s: s["pools"]["decode"]["ready"] == 3, 180, "three decode replicas")
    cluster.scale("decode", 4)
    status = wait_for(cluster, lambda s: s["resource_request"]["asks"] >= 1 and len(
        s["resource_request"]["bundles"]) == 5, 10, "Ray's autoscaler asked for five replica bundles")
    assert {"CPU": 1.0, "decode": 2.0} in status["resource_request"]["bundles"]
    status = wait_for(cluster, lambda s: s["pools"]["decode"]["shortfall"] is not None, RESOURCE_TIMEOUT_S + 10,
                      "the shortfall reported")
    short = status["pools"]["decode"]["shortfall"]
    assert short["replicas"] == 1 and short["bundle"] == {"CPU": 1.0, "decode": 2.0}
    assert status["pools"]["decode"]["pending"] == 0 and status["pools"]["decode"]["ready"] == 3
    assert len(status["resource_request"]["bundles"]) == 4  # the request for the fourth is withdrawn
    assert ask(cluster).usage.completion_tokens == 8


def test_scale_down_drains_a_replica_while_it_serves(cluster):
    """Shrink from three to two while a long stream runs: whichever replica it is on, it finishes whole."""
    with TandemClient(cluster.endpoint, timeout_s=300) as client:
        stream = client.stream(prompt="Once upon a time", max_tokens=120, temperature=0, ignore_eos=True)
        first = next(stream)
        assert "pinned at 2" in cluster.scale("decode", 2)
        tokens = len(first.token_ids) + sum(len(chunk.token_ids) for chunk in stream)
    assert tokens == 120
    wait_for(cluster, lambda s: s["pools"]["decode"]["ready"] == 2 and s["pools"]["decode"]["draining"] == 0,
             120, "the drained replica to leave")
    assert any("draining" in line for line in cluster.log())
    assert "automatic" in cluster.scale("decode", None)
    wait_idle(cluster)


def wait_for_metric(cluster, name: str, value: float, timeout_s: float = 10.0, **labels) -> bool:
    deadline = time.monotonic() + timeout_s
    while metric(cluster, name, **labels) != value:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_a_dead_replica_is_detected_within_5_s_and_replaced(cluster):
    victim = ready_replicas(cluster, "decode")[-1]["name"]
    ray.kill(cluster.replica_handles()[victim])
    killed = time.monotonic()
    wait_for(cluster, lambda s: victim not in {r["name"] for r in s["replicas"]}, 10, f"{victim} removed")
    assert time.monotonic() - killed <= 5.0 + 1.0  # heartbeat every 1 s, 3 s timeout; status polls every 0.5 s
    assert any(f"{victim} is dead" in line for line in cluster.log())
    status = wait_for(cluster, lambda s: s["pools"]["decode"]["ready"] == 2, 180, "a replacement")
    assert status["replicas_replaced"] >= 1 and victim in status["router"]["replicas_lost"]
    assert ask(cluster).usage.completion_tokens == 8
    detail = {r["name"]: r for r in status["replicas"]}
    for r in (r for r in detail.values() if r["state"] == "ready"):
        assert r["pid"] and r["node"] and r["rank_placements"]
        assert [p["state"] for p in r["rank_placements"]] == ["alive"] * len(r["ranks"]), r
        assert "running" in r and "kv_blocks_in_use" in r


# -- faults injected while requests run -------------------------------------------------------------------------


def long_prompt(tag: str) -> str:
    """About 1000 tokens, unique per tag (no prefix cache hit): several prefill chunks."""
    return f"[{tag}] " + " ".join(f"Item {i} of the {tag} list is a line the model has to read." for i in range(70))


def ready_replicas(cluster, pool: str) -> list[dict]:
    return [r for r in cluster.status()["replicas"] if r["pool"] == pool and r["state"] == "ready"]


def kill_rank(replica: dict, rank: int) -> None:
    """SIGKILLs one rank process of a replica (the simulated nodes share this machine)."""
    pid = next(p["pid"] for p in replica["rank_placements"] if p["rank"] == rank)
    os.kill(pid, signal.SIGKILL)


def when_prefilling(cluster, action) -> None:
    """Calls action() as soon as a decode replica holds a reservation (the prompt is being prefilled)."""
    handles = cluster.replica_handles()
    decode = [handles[r["name"]] for r in ready_replicas(cluster, "decode")]
    deadline = time.monotonic() + 60
    while not any(s.waiting_for_kv for s in ray.get([h.stats.remote() for h in decode])):
        assert time.monotonic() < deadline, "no prefill began"
        time.sleep(0.01)
    action()


def tokens_of(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def in_thread(fn, *args):
    """Runs fn(*args) in a thread; returns a join() that gives its result or raises its error."""
    box = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # handed to join()
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(300)
        assert not thread.is_alive(), "the request did not end"
        if "error" in box:
            raise box["error"]
        return box["result"]

    return join


def test_a_decode_rank_killed_mid_stream_hands_its_streams_to_the_other_decode_replica(cluster):
    wait_for(cluster, lambda s: s["pools"]["decode"]["ready"] == 2 and not s["pools"]["decode"]["pending"], 180,
             "two decode replicas")
    # The structured one's matcher replays the delivered tokens on the other replica (its JSON runs past 48 tokens).
    rows = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 40, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}}},
        "required": ["rows"]}
    kinds = {"greedy": dict(temperature=0, ignore_eos=True),
             "seeded": dict(temperature=0.8, top_p=0.95, seed=5, frequency_penalty=0.3, ignore_eos=True),
             "structured": dict(temperature=0.8, seed=7, structured=pb.StructuredOutput(json_schema=json.dumps(rows)))}
    asks = {kind: dict(prompt=f"Tell me a long story about a {kind} dragon.", max_tokens=48, **params)
            for kind, params in kinds.items()}
    with TandemClient(cluster.endpoint, timeout_s=300) as client:
        whole = {kind: client.generate(**ask).token_ids[0] for kind, ask in asks.items()}  # uninterrupted
        before = cluster.status()["router"]["migrations"]
        streams = {kind: client.stream(**ask) for kind, ask in asks.items()}
        firsts = {kind: next(stream) for kind, stream in streams.items()}
        victim = firsts["greedy"].decode_replica
        kill_rank(next(r for r in ready_replicas(cluster, "decode") if r["name"] == victim), rank=1)
        got = {kind: list(firsts[kind].token_ids) + tokens_of(stream) for kind, stream in streams.items()}
    assert got == whole  # no duplicated or missing token, on either stream
    status = wait_for(cluster, lambda s: victim in s["router"]["replicas_lost"], 10, f"{victim} lost")
    moved = sum(1 for kind in kinds if firsts[kind].decode_replica == victim)
    assert status["router"]["migrations"] - before >= moved >= 1
    assert any(f"{victim} is dead" in line for line in cluster.log())
    wait_idle(cluster)


def test_a_dropped_transfer_connection_has_the_prompt_prefilled_again(cluster):
    wait_for(cluster, lambda s: s["pools"]["prefill"]["ready"] >= 1, 180, "a prefill replica")
    handles = cluster.replica_handles()
    prefill = [handles[r["name"]] for r in ready_replicas(cluster, "prefill")]
    ask = dict(prompt=long_prompt("dropped"), max_tokens=12, temperature=0)
    with TandemClient(cluster.endpoint, timeout_s=300) as client:
        before = cluster.status()["router"]["transfer_fallbacks"]
        result = in_thread(lambda: client.generate(**ask))
        drills = []

        def drill() -> None:  # again until it reaches the transfer (the prefill call may not have armed it yet)
            deadline = time.monotonic() + 30
            while not any(not d.startswith("0 ") for d in drills) and time.monotonic() < deadline:
                drills.extend(ray.get([h.inject_fault.remote("drop_kv_connections") for h in prefill]))

        when_prefilling(cluster, drill)
        faulted = result()
        assert any(not d.startswith("0 ") for d in drills), drills  # the transfer was running when it dropped
        assert faulted.token_ids == client.generate(**ask).token_ids  # as if nothing had happened
    assert cluster.status()["router"]["transfer_fallbacks"] == before + 1
    wait_idle(cluster)


def test_a_prefill_rank_killed_mid_prefill_has_the_prompt_prefilled_again(cluster):
    wait_for(cluster, lambda s: s["pools"]["prefill"]["ready"] >= 1, 180, "a prefill replica")
    victims = ready_replicas(cluster, "prefill")
    ask = dict(prompt=long_prompt("killed"), max_tokens=12, temperature=0)
    with TandemClient(cluster.endpoint, timeout_s=300) as client:
        before = cluster.status()["router"]["prefill_retries"]
        result = in_thread(lambda: client.generate(**ask))
        when_prefilling(cluster, lambda: [kill_rank(victim, rank=1) for victim in victims])
        faulted = result()
        assert faulted.token_ids == client.generate(**ask).token_ids
    status = wait_for(cluster, lambda s: all(v["name"] in s["router"]["replicas_lost"] for v in victims), 10,
                      "the prefill replicas lost")
    # One retry per dead replica at most: with two prefill replicas (the pool may have grown) the first retry can
    # land on the other one before its death is noticed.
    assert 1 <= status["router"]["prefill_retries"] - before <= len(victims), (status["router"], len(victims))
    wait_idle(cluster)  # its replacement starts meanwhile (the dead replica test waits for one)


def test_a_killed_router_is_replaced_and_clients_reconnect_within_10_s(cluster):
    # A whole cluster first (the prefill test above leaves a replacement prefill replica starting): the 10 s are
    # the router's, and the new router's index is rebuilt from every replica's snapshot.
    wait_for(cluster, lambda s: all(s["pools"][p]["ready"] >= 1 and not s["pools"][p]["pending"]
                                    for p in ("prefill", "decode")) and s["router"]["standby"] == "ready", 180,
             "every pool ready and a warm standby router")
    router = ray.get_actor(f"{cluster.name}-router", namespace=cluster.namespace)
    ray.kill(router)
    killed = time.monotonic()
    while True:
        try:
            result = ask(cluster)
            break
        except Exception:
            if time.monotonic() - killed > 10:
                raise
            time.sleep(0.25)
    assert result.usage.completion_tokens == 8
    took = time.monotonic() - killed
    print(f"a killed router: a client's request answered {took:.2f} s after the kill")
    print("\n".join(cluster.log()[-8:]))
    assert took <= 10
    log = cluster.log()
    assert any("router: replacing it" in line for line in log)
    assert any("the standby router took over" in line for line in log), log[-10:]
    wait_for(cluster, lambda s: s["router"]["standby"] == "ready", 120, "a new warm standby router")
    feed = cluster.status()["router"]["kv_feed"]
    assert feed["snapshots"] >= 3  # the new router's prefix index was rebuilt from every replica's snapshot
