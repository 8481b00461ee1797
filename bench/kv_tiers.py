"""KV tiers on the local cluster: `tandem bench --workload sessions` (multi-turn chats) against the colocated
manifest with a small KV pool, tiers off against a host tier (and a host + disk tier), one run, the same seed and
rate. The sessions' working set is several times the pool, so without tiers each turn's history was evicted and is
computed again; with them it is copied back.

    .venv/bin/python bench/kv_tiers.py [--pool-blocks 128] [--sessions 8] [--turns 3] [--rate 0.5] [--modes off,host,disk]

Each mode starts the cluster on a local Ray head this script starts and stops (none may be running). The last line
is one JSON object: per mode, prefix hit rate, TTFT p50/p90, ITL p99 and the replica's tier counters; and the
ratios against tiers off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "manifests" / "local-colocated.yaml"
BLOCK_BYTES = 737_280  # one block of the embedded model's float32 KV: 30 layers x K,V x 3 heads x 16 x 64 x 4 B


def tiers_of(mode: str, disk: Path) -> dict | None:
    if mode == "off":
        return None
    if mode == "host":
        return {"host_bytes": 2 << 30}
    return {"host_bytes": 64 * BLOCK_BYTES, "disk_path": str(disk), "disk_bytes": 4 << 30}  # most blocks on disk


def run_mode(mode: str, args, disk: Path) -> dict:
    import ray

    from tandem.cluster import launcher
    from tandem.cluster.manifest_yaml import load_manifest

    manifest = load_manifest(MANIFEST)
    pool = manifest.pools.decode
    engine = pool.engine.model_copy(update={"kv_cache_bytes": args.pool_blocks * BLOCK_BYTES, "speculative": None,
                                            "kv_tiers": None})
    if (tiers := tiers_of(mode, disk)) is not None:
        from tandem.cluster.engine_settings import KVTiersSettings

        engine = engine.model_copy(update={"kv_tiers": KVTiersSettings(**tiers)})
    manifest = manifest.model_copy(update={
        "listen": manifest.listen.model_copy(update={"grpc": "127.0.0.1:0", "http": None}),
        "pools": manifest.pools.model_copy(update={"decode": pool.model_copy(update={"engine": engine})})})
    cluster = launcher.up(manifest, out=sys.stderr)
    try:
        if not cluster.started_ray:
            raise RuntimeError("a Ray cluster was already running; stop it so that every mode gets the same cores")
        with tempfile.TemporaryDirectory() as out:
            command = [str(Path(sys.executable).parent / "tandem"), "bench", "--target", cluster.endpoint,
                       "--workload", "sessions", "--turns", str(args.turns), "--think-time", str(args.think_time),
                       "--rate", str(args.rate), "--num-requests", str(args.sessions), "--input", args.input,
                       "--output", args.output, "--seed", str(args.seed), "--quiet", "--out", out]
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise RuntimeError(f"tandem bench failed: {done.stderr[-2000:]}")
            summary = json.loads(done.stdout.strip().splitlines()[-1])
        replicas = cluster.status()["replicas"]
        tier_stats = replicas[0].get("kv_tiers") if replicas else None
    finally:
        cluster.shutdown()
        ray.shutdown()
    return {"completed": summary["completed"], "failed": summary["failed"],
            "prefix_hit_rate": summary["prefix_hit_rate"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "ttft_p90_ms": summary["ttft_ms"]["p90"], "itl_p99_ms": summary["itl_ms"]["p99"],
            "tiers": tier_stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-blocks", type=int, default=128, help="the replica's KV pool, in blocks of 16 tokens")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--think-time", type=float, default=2.0)
    p.add_argument("--rate", type=float, default=0.5, help="sessions started per second")
    p.add_argument("--input", default="fixed:384", help="tokens of each user message")
    p.add_argument("--output", default="fixed:32", help="tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,host,disk")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as disk:
        for mode in args.modes.split(","):
            print(f"kv_tiers bench: tiers {mode}", file=sys.stderr)
            results[mode] = run_mode(mode, args, Path(disk))
    base = results.get("off")
    ratios = {}
    if base:
        for mode, r in results.items():
            if mode != "off":
                ratios[mode] = {"ttft_p50_off_over_on": base["ttft_p50_ms"] / r["ttft_p50_ms"],
                                "ttft_p90_off_over_on": base["ttft_p90_ms"] / r["ttft_p90_ms"],
                                "itl_p99_on_over_off": r["itl_p99_ms"] / base["itl_p99_ms"]}
    working_set = args.sessions * args.turns * (int(args.input.split(":")[1]) + int(args.output.split(":")[1]))
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split(":")[1].split() if f.startswith(("avx", "amx"))})
    print(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                  "flags": flags},
                      "config": vars(args) | {"working_set_over_pool": working_set / (16 * args.pool_blocks)},
                      "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
