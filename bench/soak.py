"""A soak under chaos (issue 48): open-loop load on the local disaggregated cluster (deploy/manifests/
local-failover.yaml, started the way `tandem up` starts it: a local Ray head with token auth, a prefill replica
of two TP ranks, two decode replicas of two PP ranks) for --minutes, while a chaos driver, every 20-40 s, does one
of: SIGKILL a random rank of a random replica; drop every prefill replica's KV transfer connections; kill the
router (the control plane replaces it); stall a random replica (SIGSTOP its ranks for 2-5 s, then SIGCONT).

Every request is greedy or seeded sampling on one of a few chat prompts, so its answer is known: the tokens one
process gives for it (tandem's Generator, computed here before the load starts). Afterwards each request is one
of: identical (completed with those tokens), failed with a documented error (a gRPC status tandem documents for
the cause: UNAVAILABLE for a router or replica that went away, RESOURCE_EXHAUSTED at capacity, with a message),
or a violation: different tokens, an undocumented status (INTERNAL, UNKNOWN), or no answer within its deadline
(lost). Then: no replica holds a request or a KV block (and each replica's bookkeeping checks itself), and the
router's and each replica's resident memory at the end is within 10% of its level one minute into its life.

    .venv/bin/python bench/soak.py --minutes 10        # make soak
    .venv/bin/python bench/soak.py --minutes 2         # the short form tests/cluster/test_soak.py runs

Prints progress, the chaos log as it happens, then one JSON object (the last line) with every figure and "ok".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import ray

from tandem.cluster import launcher
from tandem.cluster.manifest_yaml import load_manifest
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.client import build_request

ROOT = Path(__file__).resolve().parents[1]

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Who wrote Hamlet?", "Describe a cat in one sentence."]
KINDS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.8, top_p=0.95, seed=17)}
DOCUMENTED = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}  # what a request may end with here, with a message
MEMORY_BASELINE_S = 60.0
MEMORY_TOLERANCE = 0.10


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def references(max_tokens: int) -> dict[tuple[int, str], list[int]]:
    """The tokens one process gives for every (question, kind) the load sends."""
    from tandem.engine.core.generator import Generator
    from tandem.engine.loader import load_model
    from tandem.engine.sampling_params import SamplingParams

    loaded = load_model(None, progress=False)
    with Generator(loaded, max_model_len=2048) as one:
        return {(q, kind): one.generate(loaded.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[q]}]),
                                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)).token_ids
                for q in range(len(QUESTIONS)) for kind, params in KINDS.items()}


class Load:
    """Open-loop requests (Poisson arrivals at `rate` per second) over gRPC; each one's outcome in outcomes."""

    def __init__(self, target: str, rate: float, max_tokens: int, deadline_s: float, seed: int):
        self.target, self.rate, self.max_tokens, self.deadline_s = target, rate, max_tokens, deadline_s
        self.rng = random.Random(seed)
        self.outcomes: list[dict] = []
        self.stop = threading.Event()

    async def _one(self, stub, q: int, kind: str, sent: float) -> None:
        request = build_request(chat=[{"role": "user", "content": QUESTIONS[q]}], max_tokens=self.max_tokens,
                                ignore_eos=True, **KINDS[kind])
        tokens: list[int] = []
        outcome = {"q": q, "kind": kind, "sent": round(sent, 2)}
        try:
            async for response in stub.Generate(request, timeout=self.deadline_s):
                tokens.extend(response.token_ids)
            outcome |= {"status": "OK", "tokens": tokens}
        except grpc.aio.AioRpcError as e:
            outcome |= {"status": e.code().name, "details": (e.details() or "")[:200]}
        outcome["took"] = round(time.monotonic() - sent, 2)
        self.outcomes.append(outcome)

    async def run(self, started: float) -> None:
        tasks = []
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.TandemStub(channel)
            while not self.stop.is_set():
                await asyncio.sleep(self.rng.expovariate(self.rate))
                q, kind = self.rng.randrange(len(QUESTIONS)), self.rng.choice(list(KINDS))
                tasks.append(asyncio.create_task(self._one(stub, q, kind, time.monotonic() - started)))
            await asyncio.gather(*tasks)


class Chaos:
    """One fault every 20-40 s, chosen at random; each logged with what it hit."""

    ACTIONS = ("kill_rank", "drop_kv_connections", "kill_router", "stall_replica")

    def __init__(self, cluster, seed: int, every: tuple[float, float]):
        self.cluster, self.rng, self.every = cluster, random.Random(seed + 1), every
        self.log: list[dict] = []
        self.stop = threading.Event()

    def _replicas(self) -> list[dict]:
        return [r for r in self.cluster.status()["replicas"] if r["state"] == "ready" and r.get("rank_placements")]

    def act(self, action: str) -> str:
        if action == "kill_rank":
            replica = self.rng.choice(self._replicas())
            placement = self.rng.choice(replica["rank_placements"])
            os.kill(placement["pid"], signal.SIGKILL)
            return f"SIGKILL rank {placement['rank']} of {replica['name']} (pid {placement['pid']})"
        if action == "drop_kv_connections":
            handles = self.cluster.replica_handles()
            prefill = [handles[r["name"]] for r in self._replicas() if r["pool"] == "prefill" and r["name"] in handles]
            return "; ".join(ray.get([h.inject_fault.remote("drop_kv_connections") for h in prefill], timeout=30))
        if action == "kill_router":  # the serving one of the router actors (the warm standby is another)
            prefix, namespace = f"{self.cluster.name}-router", self.cluster.namespace
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["namespace"] == namespace and a["name"].startswith(prefix)]
            for name in names:
                router = ray.get_actor(name, namespace=self.cluster.namespace)
                if ray.get(router.stats.remote(), timeout=10).state == "serving":
                    ray.kill(router)
                    return f"ray.kill the router ({name})"
            raise RuntimeError(f"no serving router among {names}")
        replica = self.rng.choice(self._replicas())
        pids = [p["pid"] for p in replica["rank_placements"]]
        pause = self.rng.uniform(2.0, 5.0)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {replica['name']} ({len(pids)} ranks) for {pause:.1f} s"

    def run(self, started: float) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every)):
            action = self.rng.choice(self.ACTIONS)
            entry = {"t": round(time.monotonic() - started, 1), "action": action}
            try:
                entry["did"] = self.act(action)
            except Exception as e:  # e.g. no ready replica right now: logged, the soak goes on
                entry["error"] = f"{type(e).__name__}: {e}"[:200]
            self.log.append(entry)
            say(f"chaos: {entry}")


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def router_pids() -> list[int]:
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RouterActor"):
                found.append(pid)
        except OSError:
            continue
    return found


class Memory:
    """Resident memory of the router and of each replica (its ranks summed), sampled every few seconds, keyed by
    process (a replaced router or replica is a new series)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.series: dict[str, list[tuple[float, int]]] = {}
        self.stop = threading.Event()

    def sample(self, t: float) -> None:
        for pid in router_pids():
            if (rss := rss_bytes(pid)) is not None:
                self.series.setdefault(f"router pid {pid}", []).append((t, rss))
        for replica in self.cluster.status()["replicas"]:
            pids = [p["pid"] for p in replica.get("rank_placements") or () if p.get("pid")]
            sizes = [rss_bytes(pid) for pid in pids]
            if pids and None not in sizes and replica["state"] == "ready":
                key = f"{replica['name']} pids {','.join(map(str, sorted(pids)))}"
                self.series.setdefault(key, []).append((t, sum(sizes)))

    def run(self, started: float, every_s: float = 5.0) -> None:
        while not self.stop.wait(every_s):
            try:
                self.sample(time.monotonic() - started)
            except Exception as e:  # the router restarting: the next sample will do
                say(f"memory sample skipped: {e!r}")

    def growth(self) -> dict[str, dict]:
        """Per series that lived past MEMORY_BASELINE_S and to the end: its level then, at the end, and the ratio."""
        end = max((s[-1][0] for s in self.series.values()), default=0.0)
        report = {}
        for key, samples in self.series.items():
            first = samples[0][0]
            base = next(((t, rss) for t, rss in samples if t >= first + MEMORY_BASELINE_S), None)
            if base is None or samples[-1][0] < end - 10 or samples[-1][0] - base[0] < 20:
                continue  # too short a life (replaced, or started near the end) to judge
            report[key] = {"baseline_mb": round(base[1] / 2**20, 1), "end_mb": round(samples[-1][1] / 2**20, 1),
                           "growth": round(samples[-1][1] / base[1] - 1, 3)}
        return report


def settle(cluster, timeout_s: float) -> list[dict]:
    """Waits until no replica runs, waits or holds a KV block; returns what still does after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [{k: r.get(k) for k in ("name", "kv_blocks_in_use", "running", "waiting", "waiting_for_kv")}
                for r in cluster.status()["replicas"] if r["state"] == "ready" and
                any(r.get(k) for k in ("kv_blocks_in_use", "running", "waiting", "waiting_for_kv"))]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (open loop)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chaos-every", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--deadline", type=float, default=180.0, help="each request's gRPC deadline (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--manifest", default=str(ROOT / "deploy" / "manifests" / "local-failover.yaml"))
    args = parser.parse_args()

    say("computing the one-process answers")
    want = references(args.max_tokens)
    manifest = load_manifest(Path(args.manifest))
    manifest = manifest.model_copy(update={"listen": manifest.listen.model_copy(
        update={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"})})
    cluster = launcher.up(manifest)
    try:
        status = cluster.status()
        while not all(p["ready"] >= p["replicas"]["initial"] for p in status["pools"].values()):
            time.sleep(2.0)
            status = cluster.status()
        say(f"cluster up: {[r['name'] for r in status['replicas']]}; load {args.rate}/s for {args.minutes:g} min")
        started = time.monotonic()
        load = Load(cluster.endpoint, args.rate, args.max_tokens, args.deadline, args.seed)
        chaos, memory = Chaos(cluster, args.seed, tuple(args.chaos_every)), Memory(cluster)
        threads = [threading.Thread(target=chaos.run, args=(started,), daemon=True),
                   threading.Thread(target=memory.run, args=(started,), daemon=True)]
        for thread in threads:
            thread.start()
        loader = threading.Thread(target=lambda: asyncio.run(load.run(started)), daemon=True)
        loader.start()
        time.sleep(args.minutes * 60)
        chaos.stop.set()
        memory.stop.set()
        load.stop.set()
        say("load stopped; waiting for the requests still running")
        loader.join(args.deadline + 30)
        for thread in threads:
            thread.join(60)
        busy = settle(cluster, 120.0)
        handles = cluster.replica_handles()
        ready = [r["name"] for r in cluster.status()["replicas"] if r["state"] == "ready"]
        integrity = []
        for name in ready:
            try:
                ray.get(handles[name].check_integrity.remote(), timeout=60)
            except Exception as e:
                integrity.append(f"{name}: {e!r}"[:300])
        memory.sample(time.monotonic() - started)
        report = verdict(load.outcomes, want, chaos.log, busy, integrity, memory.growth(), args, loader.is_alive())
    finally:
        cluster.shutdown()
    print(json.dumps(report))


def verdict(outcomes, want, chaos_log, busy, integrity, growth, args, load_hung: bool) -> dict:
    counts = {"identical": 0, "failed_documented": 0, "different": 0, "undocumented_error": 0, "lost": 0}
    failed_by_code: dict[str, int] = {}
    violations = []
    for o in outcomes:
        if o["status"] == "OK":
            same = o["tokens"] == want[(o["q"], o["kind"])]
            counts["identical" if same else "different"] += 1
            if not same:
                violations.append({k: o[k] for k in ("q", "kind", "sent")} | {"why": "different tokens"})
        elif o["status"] == "DEADLINE_EXCEEDED":
            counts["lost"] += 1
            violations.append({k: o[k] for k in ("q", "kind", "sent", "took")} | {"why": "no answer in time"})
        elif o["status"] in DOCUMENTED and o.get("details"):
            counts["failed_documented"] += 1
            failed_by_code[o["status"]] = failed_by_code.get(o["status"], 0) + 1
        else:
            counts["undocumented_error"] += 1
            violations.append({k: o.get(k) for k in ("q", "kind", "sent", "status", "details")})
    reasons: dict[str, int] = {}  # each failure's message with the names of replicas and requests taken out
    for o in outcomes:
        if o["status"] != "OK":
            reason = re.sub(r"(prefill|decode)-\d+", r"\1-N", re.sub(r"'[^']*'", "'...'", o.get("details", "")))
            reasons[f"{o['status']}: {reason}"] = reasons.get(f"{o['status']}: {reason}", 0) + 1
    timeline = []  # per minute of sending: requests sent, and how they ended
    for minute in range(int(max((o["sent"] for o in outcomes), default=0) // 60) + 1):
        sent = [o for o in outcomes if minute * 60 <= o["sent"] < (minute + 1) * 60]
        timeline.append({"minute": minute, "sent": len(sent), "identical": sum(o["status"] == "OK" for o in sent),
                         "failed": sum(o["status"] != "OK" for o in sent)})
    leaks_ok = not busy and not integrity
    memory_ok = all(g["growth"] <= MEMORY_TOLERANCE for g in growth.values())
    ok = not violations and leaks_ok and memory_ok and not load_hung and counts["identical"] > 0
    return {"bench": "soak", "minutes": args.minutes, "rate_per_s": args.rate, "max_tokens": args.max_tokens,
            "requests": len(outcomes), "outcomes": counts, "failed_by_code": failed_by_code,
            "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])), "timeline": timeline,
            "violations": violations[:20], "chaos": chaos_log,
            "replicas_still_busy": busy, "integrity_errors": integrity, "memory": growth,
            "memory_tolerance": MEMORY_TOLERANCE, "load_hung": load_hung, "ok": ok}


if __name__ == "__main__":
    main()
