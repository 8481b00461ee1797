"""The autoscaler against a quiet / 10x burst / quiet load: the load generator (bench/loadgen, what `tandem bench`
runs) drives an in-process cluster of batching mock replicas (cluster/mock_cluster.py: the router's real request
driver, routing and KV feed, and the control plane's real per-pool scaling loops) whose new replicas serve
--start-delay seconds after the decision. Peers in the same run: the same cluster with autoscaling off, fixed at
the pools' minimum and at their maximum. Reports, per deployment and phase, the SLO attainment (TTFT and mean
ITL within the SLO) of the requests that arrived in it, and of the burst's requests that arrived once it had
been absorbed (--absorb start-up delays after it began); decisions per pool and phase; requests lost (failed
once admitted) and refused (RESOURCE_EXHAUSTED: no room within --queue-timeout); replica-seconds (what
the deployment cost); and plots the replica counts over time (PNG).

    python bench/autoscale.py                      # virtual time: exact step costs, minutes of load in seconds
    python bench/autoscale.py --real-time --quiet-s 30 --burst-s 60

Virtual time (cluster/virtual_time.py) runs the same code on a clock that jumps over idle time: the mock replicas'
steps take exactly their modelled cost whatever this machine's speed, and the run takes as long as its Python
work. --real-time runs it on the wall clock instead (then a 2-core machine's own speed shows in the latencies).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tandem.bench.loadgen.records import Clock, RequestRecord, WorkRequest
from tandem.bench.loadgen.runner import open_loop
from tandem.bench.loadgen.stats import SLO as RequestSLO
from tandem.bench.loadgen.stats import RequestMetrics, meets
from tandem.bench.loadgen.workloads import Conversation
from tandem.cluster.autoscaling import ScalingSettings
from tandem.cluster.mock_cluster import MockCluster
from tandem.cluster.pool_pressure import SLO
from tandem.cluster.simulation import LoopClock
from tandem.cluster.virtual_time import run_virtual
from tandem.router.driver_settings import DriverSettings
from tandem.router.mocks.batching import StepCosts
from tandem.router.serving import error_code

POOLS = ("prefill", "decode")


class ClusterBackend:
    """The load generator's Backend over MockCluster.generate (token-id prompts, greedy, ignore_eos)."""

    name = "mock cluster"

    def __init__(self, cluster: MockCluster):
        self.cluster = cluster
        self._ids = itertools.count()

    async def send(self, request: WorkRequest, record: RequestRecord, clock: Clock) -> str:
        record.sent_s = clock.now()
        try:
            timings = await self.cluster.generate(f"bench-{next(self._ids)}", request.prompt_ids,
                                                  request.max_tokens,
                                                  on_tokens=lambda n: record.on_tokens(clock.now(), n))
            record.end_s = clock.now()
            record.prompt_tokens, record.output_tokens = len(request.prompt_ids), request.max_tokens
            record.server_timings = asdict(timings)
        except asyncio.CancelledError:
            record.fail("cancelled", "the run ended before the request finished")
            raise
        except Exception as e:
            record.fail(*error_code(e))
        return ""

    async def aclose(self) -> None:
        pass


def schedule(phases: list[tuple[str, float, float]], prompt_tokens: int, output_tokens: int,
             seed: int) -> list[Conversation]:
    """Poisson arrivals: phases of (name, seconds, requests per second), one after the other."""
    rng = random.Random(seed)
    conversations, start = [], 0.0
    for name, seconds, rate in phases:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            prompt = tuple(rng.randrange(1, 30000) for _ in range(prompt_tokens))
            conversations.append(Conversation(t, (WorkRequest(output_tokens, prompt, klass=name),)))
            t += rng.expovariate(rate)
        start += seconds
    return conversations


async def run_deployment(args, phases, conversations, *, autoscale: bool, initial: int) -> dict:
    costs = StepCosts(step_s=args.step_s, decode_token_s=args.decode_token_s, prefill_token_s=args.prefill_token_s,
                      max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs)
    settings = ScalingSettings(interval_s=1.0, up_window_s=args.up_window, down_window_s=args.down_window)
    # The driver's own queue may hold the burst while capacity comes (the router's admission control, in front of
    # the driver in a real cluster, is not what this measures); requests it still refuses count as refused.
    driver = DriverSettings(max_queued_requests=100_000, queue_timeout_s=args.queue_timeout,
                            prefill_queue_tokens=args.prefill_queue_tokens)
    cluster = MockCluster("disaggregated", costs, initial={p: initial for p in POOLS},
                          bounds={p: (args.min, args.max) for p in POOLS}, slo=SLO(args.ttft, args.itl),
                          settings=settings, start_delay_s=args.start_delay, autoscale=autoscale,
                          driver_settings=driver)
    timeline: list[dict] = []
    async with cluster.running():
        clock = LoopClock()

        async def sample() -> None:
            while True:
                driver = cluster.driver
                row = {"t": clock.now(), "queued_prefill_tokens": sum(r.load.queued_prefill_tokens
                                                                      for r in driver.prefill),
                       "waiting_for_room": driver.num_queued, "waiting_for_prefill": driver.num_waiting_prefill,
                       "decode_in_flight": sum(r.load.in_flight for r in driver.decode)}
                for pool in POOLS:
                    counts = cluster.counts(pool)
                    row[pool] = {"ready": counts.ready, "starting": counts.starting, "draining": counts.draining}
                timeline.append(row)
                await asyncio.sleep(1.0)

        sampler = asyncio.get_running_loop().create_task(sample())
        started = time.perf_counter()
        records = await open_loop(conversations, ClusterBackend(cluster), clock=clock, quiet=True)
        wall = time.perf_counter() - started
        sampler.cancel()
        decisions = {p: [{"t": d.t - clock.start, "action": d.action, "from": d.current, "to": d.desired,
                          "reason": d.reason} for d in cluster.decisions(p)] for p in POOLS}
    return {"records": records, "timeline": timeline, "decisions": decisions, "wall_s": wall}


def report(args, phases, result: dict) -> dict:
    slo = RequestSLO(ttft=args.ttft, tpot=args.itl)
    records: list[RequestRecord] = result["records"]
    bounds, start = {}, 0.0
    for name, seconds, _ in phases:
        bounds[name] = (start, start + seconds)
        start += seconds
    absorbed_from = bounds["burst"][0] + args.absorb * args.start_delay

    def attainment(selected: list[RequestRecord]) -> float | None:
        if not selected:
            return None
        return sum(1 for r in selected if r.ok and meets(slo, RequestMetrics.of(r))) / len(selected)

    phase_rows = {}
    for name, (a, b) in bounds.items():
        mine = [r for r in records if a <= r.scheduled_s < b]
        phase_rows[name] = {"requests": len(mine), "attainment": attainment(mine),
                            "decisions": {p: sum(1 for d in result["decisions"][p] if a <= d["t"] < b) for p in POOLS}}
    burst_end = bounds["burst"][1]
    absorbed = [r for r in records if absorbed_from <= r.scheduled_s < burst_end]
    peak = {p: max(row[p]["ready"] for row in result["timeline"]) for p in POOLS}
    replica_s = sum(row[p]["ready"] + row[p]["starting"] + row[p]["draining"] for row in result["timeline"]
                    for p in POOLS)
    return {"phases": phase_rows, "attainment_after_absorb": attainment(absorbed), "absorbed_from_s": absorbed_from,
            "refused": sum(1 for r in records if r.error == "RESOURCE_EXHAUSTED"),
            "lost": sum(1 for r in records if not r.ok and r.error != "RESOURCE_EXHAUSTED"),
            "errors": sorted({r.error for r in records if r.error}),
            "requests": len(records), "peak_replicas": peak, "replica_seconds": replica_s,
            "decisions": result["decisions"], "wall_s": round(result["wall_s"], 1)}


def plot(path: Path, phases, runs: dict[str, dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for ax, pool in zip(axes, POOLS):
        for label, run in runs.items():
            t = [row["t"] for row in run["timeline"]]
            ax.step(t, [row[pool]["ready"] for row in run["timeline"]], where="post", label=f"{label}: ready")
            if label == "autoscaled":
                ax.step(t, [row[pool]["ready"] + row[pool]["starting"] for row in run["timeline"]], where="post",
                        linestyle=":", label="autoscaled: ready + starting")
        start = 0.0
        for name, seconds, rate in phases:
            ax.axvspan(start, start + seconds, alpha=0.08 if name == "burst" else 0.0, color="red")
            ax.text(start + 1, 0.2, f"{name}\n{rate:g} req/s", fontsize=8)
            start += seconds
        ax.set_title(f"{pool} pool replicas")
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("replicas")
    axes[1].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"quiet / 10x burst / quiet; start-up delay {args.start_delay:g} s; SLO TTFT {args.ttft:g} s, "
                 f"ITL {1000 * args.itl:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quiet-rate", type=float, default=4.0, help="requests per second when quiet (burst: 10x)")
    p.add_argument("--quiet-s", type=float, default=60.0)
    p.add_argument("--burst-s", type=float, default=180.0)
    p.add_argument("--after-s", type=float, default=180.0, help="the quiet phase after the burst")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--ttft", type=float, default=1.0, help="TTFT SLO, seconds")
    p.add_argument("--itl", type=float, default=0.05, help="ITL SLO (mean per request), seconds")
    p.add_argument("--start-delay", type=float, default=20.0, help="seconds from a decision to a new replica serving")
    p.add_argument("--absorb", type=float, default=2.0, help="start-up delays after the burst began it counts as "
                                                              "absorbed")
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=16)
    p.add_argument("--up-window", type=float, default=10.0)
    p.add_argument("--down-window", type=float, default=60.0)
    p.add_argument("--step-s", type=float, default=0.012, help="mock step cost: fixed part, seconds")
    p.add_argument("--decode-token-s", type=float, default=0.0003, help="... per decoding sequence")
    p.add_argument("--prefill-token-s", type=float, default=5e-5, help="... per prompt token computed")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--queue-timeout", type=float, default=300.0, help="how long a request may wait for decode room")
    p.add_argument("--prefill-queue-tokens", type=int, default=8192,
                   help="router.prefill_queue_tokens: late binding to prefill replicas (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real-time", action="store_true", help="run on the wall clock instead of virtual time")
    p.add_argument("--peers", default="fixed-min,fixed-max", help="static deployments to compare with ('' none)")
    p.add_argument("--out", default="bench-results/autoscale", help="folder for the plot and results.json")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    phases = [("quiet", args.quiet_s, args.quiet_rate), ("burst", args.burst_s, 10 * args.quiet_rate),
              ("after", args.after_s, args.quiet_rate)]
    conversations = schedule(phases, args.prompt_tokens, args.output_tokens, args.seed)
    deployments = {"autoscaled": (True, args.min)}
    for peer in filter(None, args.peers.split(",")):
        deployments[peer] = (False, {"fixed-min": args.min, "fixed-max": args.max}[peer])
    runs, results = {}, {}
    for label, (autoscale, initial) in deployments.items():
        print(f"autoscale bench: {label} ({len(conversations)} requests over "
              f"{sum(s for _, s, _ in phases):g} s, {'real' if args.real_time else 'virtual'} time)", file=sys.stderr)
        coroutine = run_deployment(args, phases, conversations, autoscale=autoscale, initial=initial)
        runs[label] = asyncio.run(coroutine) if args.real_time else run_virtual(coroutine)
        results[label] = report(args, phases, runs[label])
        r = results[label]
        print(f"  attainment by phase {({k: v['attainment'] for k, v in r['phases'].items()})}, after absorbing "
              f"{r['attainment_after_absorb']}, lost {r['lost']}, refused {r['refused']}, peak "
              f"{r['peak_replicas']}, replica-seconds {r['replica_seconds']}, wall {r['wall_s']} s", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(out / "replicas.png", phases, runs, args)
    summary = {"config": {k: v for k, v in vars(args).items()}, "phases": phases, "results": results,
               "plot": str(out / "replicas.png")}
    auto = results["autoscaled"]
    summary["targets"] = {
        "attainment_after_absorb_ge_0.9": (auto["attainment_after_absorb"] or 0) >= 0.9,
        "decisions_per_pool_per_phase_le_2": all(n <= 2 for ph in auto["phases"].values()
                                                 for n in ph["decisions"].values()),
        "zero_lost": auto["lost"] == 0 and auto["refused"] == 0}
    if "fixed-max" in results:
        summary["replica_seconds_vs_fixed_max"] = auto["replica_seconds"] / max(1, results["fixed-max"]
                                                                                ["replica_seconds"])
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    result = main()
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, default=str))
