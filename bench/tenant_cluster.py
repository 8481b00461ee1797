"""Two tenants on the local cluster (deploy/manifests/bench-tenants.yaml: the embedded model, one colocated
replica on both cores), measured with `tandem bench --tenant` (issue 50): a steady interactive tenant ("chat",
--rate requests/s, short prompts) alone, then with a batch tenant at --batch-factor times its rate (long prompts),
under the decode pool's scheduler policy fcfs and then fair. Two clusters (one per policy) on a local Ray head
this script starts and stops; the keys are generated here. The interactive tenant's TTFT p50/p99 in each run, and
its p99 against alone. The last line of output is one JSON object with every number.

    .venv/bin/python bench/tenant_cluster.py [--rate 0.15] [--batch-factor 5] [--duration 120] [--budget 256]
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


def bench(target: str, args, tenants: list[str], out: Path) -> dict:
    """One `tandem bench` run of the tenants given (their --tenant flags); its summary."""
    from tandem.cluster.cli import main

    argv = ["bench", "--quiet", "--target", target, "--rate", str(args.rate), "--duration", str(args.duration),
            "--output", "fixed:32", "--seed", str(args.seed), "--out", str(out)]
    for tenant in tenants:
        argv += ["--tenant", tenant]
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        if main(argv) != 0:
            raise RuntimeError(f"tandem bench failed: {' '.join(argv)}")
    return json.loads(captured.getvalue().strip().splitlines()[-1])


def tenant_numbers(summary: dict, name: str) -> dict:
    mine = summary["by_class"][name]
    return {"requests": mine["requests"], "completed": mine["completed"], "ttft_p50_ms": mine["ttft_ms"]["p50"],
            "ttft_p99_ms": mine["ttft_ms"]["p99"]}


def main() -> None:
    import ray

    from tandem.cluster import launcher
    from tandem.cluster.manifest_yaml import load_manifest

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=0.15, help="the interactive tenant's requests/s")
    parser.add_argument("--batch-factor", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run")
    parser.add_argument("--chat-input", default="lognormal:96,0.3")
    parser.add_argument("--batch-input", default="uniform:600,900")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=None,
                        help="max_num_batched_tokens, a step's tokens (default: the manifest's)")
    parser.add_argument("--out", default="bench-results/tenant-cluster")
    args = parser.parse_args()
    os.environ["TANDEM_BENCH_CHAT_KEY"] = chat_key = "sk-chat-" + secrets.token_hex(12)
    os.environ["TANDEM_BENCH_BATCH_KEY"] = batch_key = "sk-batch-" + secrets.token_hex(12)
    chat = f"chat,key={chat_key},input={args.chat_input}"
    batch = f"batch,share={args.batch_factor:g},key={batch_key},input={args.batch_input}"
    results: dict = {"rate": args.rate, "batch_factor": args.batch_factor, "duration_s": args.duration,
                     "budget": args.budget or load_manifest(MANIFEST).pools.decode.engine.max_num_batched_tokens}
    for policy in ("fcfs", "fair"):
        manifest = load_manifest(MANIFEST)
        decode = manifest.pools.decode
        engine = decode.engine.model_copy(update={"max_num_batched_tokens": args.budget or
                                                  decode.engine.max_num_batched_tokens})
        decode = decode.model_copy(update={"scheduler": decode.scheduler.model_copy(update={"policy": policy}),
                                           "engine": engine})
        manifest = manifest.model_copy(update={
            "pools": manifest.pools.model_copy(update={"decode": decode}),
            "listen": manifest.listen.model_copy(update={"grpc": "127.0.0.1:0"})})
        cluster = launcher.up(manifest, out=sys.stderr)
        try:
            if not cluster.started_ray:
                raise RuntimeError("a Ray cluster was already running; stop it so that every run gets the same cores")
            if policy == "fcfs":
                print("== chat alone", file=sys.stderr, flush=True)
                alone = bench(cluster.endpoint, args, [chat], Path(args.out) / "alone")
                results["alone"] = tenant_numbers(alone, "chat")
            print(f"== chat and batch, {policy}", file=sys.stderr, flush=True)
            mixed = bench(cluster.endpoint, args, [chat, batch], Path(args.out) / policy)
            results[policy] = {"chat": tenant_numbers(mixed, "chat"), "batch": tenant_numbers(mixed, "batch")}
            print(f"{policy}: {json.dumps(results[policy])}", file=sys.stderr, flush=True)
        finally:
            cluster.shutdown()
            ray.shutdown()
    for policy in ("fcfs", "fair"):
        chat_p99 = results[policy]["chat"]["ttft_p99_ms"]
        results[f"{policy}_chat_p99_vs_alone"] = chat_p99 / results["alone"]["ttft_p99_ms"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
