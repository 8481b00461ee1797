"""Scheduling policies on the local cluster (deploy/manifests/bench-tenants.yaml: the embedded model, one colocated
replica on both cores), measured with `tandem bench` (issue 50). Two comparisons, one cluster per policy on a local
Ray head this script starts and stops, the keys generated here, the same arrivals in every run:

  tenants  a steady interactive tenant ("chat", --rate requests/s, short prompts) alone, then with a batch tenant
           at --batch-factor times its rate (long prompts), under the decode pool's scheduler policy fcfs and then
           fair (and fair with --fair-reserve-s as its fair_reserve_s, when given): the interactive tenant's TTFT
           p50/p99 in each run, and its p99 against alone.
  sjf      one tenant's long-mix (short chats with a --long-share of long prompts) at --rate under fcfs and then
           sjf: mean and p99 TTFT, and the longest any request waited in the replica's queue before its first
           scheduling against the pool's sjf aging bound, read from the request traces (the cluster sends them to
           an OTLP collector in this process: each decode_replica span's `queue` phase, replica/tracing.py).

The last line of output is one JSON object with every number.

    .venv/bin/python bench/tenant_cluster.py [--rate 0.15] [--batch-factor 5] [--duration 120] [--budget 256]
    .venv/bin/python bench/tenant_cluster.py --compare sjf --rate 0.4 --duration 240
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import sys
from pathlib import Path

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "manifests" / "bench-tenants.yaml"


def bench(target: str, args, extra: list[str], out: Path) -> dict:
    """One `tandem bench` run at args.rate for args.duration with extra flags (the tenants, the workload); its
    summary."""
    from tandem.cluster.cli import main

    argv = ["bench", "--quiet", "--target", target, "--rate", str(args.rate), "--duration", str(args.duration),
            "--seed", str(args.seed), "--out", str(out), *extra]
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        if main(argv) != 0:
            raise RuntimeError(f"tandem bench failed: {' '.join(argv)}")
    return json.loads(captured.getvalue().strip().splitlines()[-1])


def ttft_numbers(mine: dict) -> dict:
    """A summary's (or one class's) request counts and TTFT figures, in ms."""
    ttft = mine["ttft_ms"]
    return {"requests": mine["requests"], "completed": mine["completed"], "ttft_mean_ms": ttft["mean"],
            "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"], "ttft_max_ms": ttft["max"]}


@contextlib.contextmanager
def cluster_under(policy: str, budget: int | None, otlp_endpoint: str | None = None, **scheduler):
    """The bench manifest's cluster with its decode pool's scheduler policy set (and its step budget, when given;
    scheduler: more of the pool's scheduler settings; otlp_endpoint: where its traces go, None: none), on a Ray
    head of its own; stopped on exit."""
    import ray

    from tandem.cluster import launcher
    from tandem.cluster.manifest_yaml import load_manifest

    manifest = load_manifest(MANIFEST)
    decode = manifest.pools.decode
    engine = decode.engine.model_copy(update={"max_num_batched_tokens": budget or
                                              decode.engine.max_num_batched_tokens})
    decode = decode.model_copy(update={"scheduler": decode.scheduler.model_copy(update={"policy": policy,
                                                                                        **scheduler}),
                                       "engine": engine})
    manifest = manifest.model_copy(update={
        "pools": manifest.pools.model_copy(update={"decode": decode}),
        "listen": manifest.listen.model_copy(update={"grpc": "127.0.0.1:0"}),
        "observability": manifest.observability.model_copy(update={"otlp_endpoint": otlp_endpoint})})
    cluster = launcher.up(manifest, out=sys.stderr)
    try:
        if not cluster.started_ray:
            raise RuntimeError("a Ray cluster was already running; stop it so that every run gets the same cores")
        yield cluster
    finally:
        cluster.shutdown()
        ray.shutdown()


def compare_tenants(args, results: dict) -> None:
    chat = f"chat,key={os.environ['TANDEM_BENCH_CHAT_KEY']},input={args.chat_input}"
    batch = (f"batch,share={args.batch_factor:g},key={os.environ['TANDEM_BENCH_BATCH_KEY']},"
             f"input={args.batch_input}")
    output = ["--output", "fixed:32"]
    runs = [("fcfs", "fcfs", {}), ("fair", "fair", {})]
    if args.fair_reserve_s:
        runs.append(("fair_reserve", "fair", {"fair_reserve_s": args.fair_reserve_s}))
        results["fair_reserve_s"] = args.fair_reserve_s
    for name, policy, scheduler in runs:
        with cluster_under(policy, args.budget, **scheduler) as cluster:
            if name == "fcfs":
                print("== chat alone", file=sys.stderr, flush=True)
                alone = bench(cluster.endpoint, args, [*output, "--tenant", chat], Path(args.out) / "alone")
                results["alone"] = ttft_numbers(alone["by_class"]["chat"])
            print(f"== chat and batch, {name}", file=sys.stderr, flush=True)
            mixed = bench(cluster.endpoint, args, [*output, "--tenant", chat, "--tenant", batch],
                          Path(args.out) / name)
            results[name] = {tenant: ttft_numbers(mixed["by_class"][tenant]) for tenant in ("chat", "batch")}
            print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    for name, _, _ in runs:
        chat_p99 = results[name]["chat"]["ttft_p99_ms"]
        results[f"{name}_chat_p99_vs_alone"] = chat_p99 / results["alone"]["ttft_p99_ms"]


def longest_queue_s(collector) -> tuple[float, int]:
    """The longest `queue` phase of the decode replica's call spans the collector holds, and how many it holds."""
    with collector.lock:
        spans = [span for _, span in collector.spans]
    calls = {span.span_id for span in spans if span.name == "decode_replica"}
    queues = [(span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 for span in spans
              if span.name == "queue" and span.parent_span_id in calls]
    return max(queues, default=0.0), len(queues)


def compare_sjf(args, results: dict) -> None:
    import time

    from tandem.bench.otlp_collector import OTLPCollector

    aging_s = results["sjf_aging_s"] = args.sjf_aging
    workload = ["--api-key", os.environ["TANDEM_BENCH_CHAT_KEY"], "--workload", "long-mix",
                "--input", args.chat_input, "--long-share", str(args.long_share), "--long-input", args.long_input,
                "--output", "fixed:48"]
    for policy in ("fcfs", "sjf"):
        collector = OTLPCollector()
        try:
            with cluster_under(policy, args.budget, collector.endpoint, sjf_aging_s=aging_s) as cluster:
                print(f"== long-mix, {policy}", file=sys.stderr, flush=True)
                summary = bench(cluster.endpoint, args, workload, Path(args.out) / policy)
                time.sleep(3)  # the replica exports its spans about a second apart
                longest, traced = longest_queue_s(collector)
        finally:
            collector.close()
        results[policy] = ttft_numbers(summary)
        results[policy]["by_class"] = {name: ttft_numbers(c) for name, c in summary["by_class"].items()}
        results[policy] |= {"longest_queue_s": longest, "traced_calls": traced}
        print(f"{policy}: {json.dumps(results[policy])}", file=sys.stderr, flush=True)
    results["sjf_mean_ttft_vs_fcfs"] = results["sjf"]["ttft_mean_ms"] / results["fcfs"]["ttft_mean_ms"]
    results["sjf_waited_within_aging_bound"] = results["sjf"]["longest_queue_s"] <= aging_s


def main() -> None:
    from tandem.cluster.manifest_yaml import load_manifest

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=("tenants", "sjf"), default="tenants")
    parser.add_argument("--rate", type=float, default=0.15, help="tenants: the interactive tenant's requests/s; "
                                                                 "sjf: the long-mix's")
    parser.add_argument("--batch-factor", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run")
    parser.add_argument("--chat-input", default="lognormal:96,0.3", help="the interactive (sjf: short) prompts")
    parser.add_argument("--batch-input", default="uniform:600,900")
    parser.add_argument("--long-share", type=float, default=0.15, help="sjf: the share of long prompts")
    parser.add_argument("--long-input", default="uniform:1024,1536", help="sjf: the long prompts")
    parser.add_argument("--sjf-aging", type=float, default=10.0, help="sjf: the pool's sjf_aging_s")
    parser.add_argument("--fair-reserve-s", type=float, default=0.0,
                        help="tenants: also run fair with this fair_reserve_s (0: not)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=None,
                        help="max_num_batched_tokens, a step's tokens (default: the manifest's)")
    parser.add_argument("--out", default="bench-results/tenant-cluster")
    args = parser.parse_args()
    os.environ["TANDEM_BENCH_CHAT_KEY"] = "sk-chat-" + secrets.token_hex(12)
    os.environ["TANDEM_BENCH_BATCH_KEY"] = "sk-batch-" + secrets.token_hex(12)
    results: dict = {"compare": args.compare, "rate": args.rate, "duration_s": args.duration,
                     "budget": args.budget or load_manifest(MANIFEST).pools.decode.engine.max_num_batched_tokens}
    if args.compare == "tenants":
        results["batch_factor"] = args.batch_factor
        compare_tenants(args, results)
    else:
        compare_sjf(args, results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
