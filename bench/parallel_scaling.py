"""Decode throughput, per-rank memory and communication share of one replica split over processes.

For the embedded model (SmolLM2-135M, dense): tp=1 (one process, the peer), tp=2 and pp=2. For a synthetic
Mixtral-shaped MoE written by this script (random weights, 8 experts, top 2; shapes in --moe-*): ep=1 (one
process) and ep=2. Each replica serves --concurrency requests (distinct prompts, greedy, ignore_eos) of
--tokens tokens; decode tokens/s is measured over the steps after every request has its first token, in the
same run for every layout, --rounds times interleaved (median).

Per rank: weight and KV bytes it holds and, for spawned ranks, its resident memory (RSS), and over the decode window the share of
step time spent in collectives (TP all-reduce, EP all-to-all/all-gather, PP sends) and the share of the decode
window each rank spends outside its model's forward (idle). With pp > 1 the bubble is the stages' mean idle
share minus the one-process idle share (scheduling and sampling, which every layout pays), next to the GPipe
bound (pp - 1) / (micro-batches + pp - 1) for one step's pipeline fill and drain.

    .venv/bin/python bench/parallel_scaling.py [--concurrency 16] [--tokens 32] [--rounds 3] [--device cpu]

On a GPU machine pass --device cuda (NCCL). The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.engine.runner.executor import LocalExecutor

QUESTION = "Request {i}: explain, step by step, how a bicycle gear system trades speed for force."


def write_moe(folder: Path, args, tokenizer) -> Path:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=args.moe_hidden, intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.moe_layers, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=2048, initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    return folder


def rank_times(engine) -> list[dict]:
    """Per rank, seconds since start: inside steps, in the model's forward, and per kind of communication."""
    executor = engine.executor
    if isinstance(executor, LocalExecutor):
        runner = executor.runner
        return [{"rank": 0, "step_s": runner.times.steps, "forward_s": runner.times.forward, "comm_s": {}}]
    return [{"rank": s.rank, "step_s": s.step_s, "forward_s": s.forward_s, "comm_s": s.comm_s}
            for s in executor.rank_stats()]


def decode_run(engine, prompts: list[list[int]], tokens: int) -> dict:
    """Adds every prompt, steps until each has its first token, then times the decode steps."""
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    tag = time.perf_counter_ns()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(o.request_id for o in engine.step())
    before = rank_times(engine)
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    ranks = []
    for b, a in zip(before, rank_times(engine)):
        step = a["step_s"] - b["step_s"]
        comm = {k: v - b["comm_s"].get(k, 0.0) for k, v in a["comm_s"].items()}
        collectives = sum(v for k, v in comm.items() if k != "pp_wait")
        forward = a["forward_s"] - b["forward_s"]
        ranks.append({"rank": a["rank"], "step_s": step, "forward_s": forward,
                      "collective_share": collectives / step if step else 0.0,
                      # Wall time of the decode window this rank spent outside its model's forward: waiting
                      # for earlier stages, for the driver between steps, or sending.
                      "idle_share": 1 - forward / elapsed, "comm_s": comm})
    return {"decode_tokens_per_s": generated / elapsed, "decode_tokens": generated, "ranks": ranks}


def memory(engine) -> list[dict]:
    executor = engine.executor
    if isinstance(executor, LocalExecutor):
        model, data = executor.runner.model, executor.runner.kv_cache.data
        # In this process: its RSS also holds the benchmark's other models, so only the model's own bytes count.
        return [{"rank": 0, "weight_bytes": model.weight_bytes(), "kv_cache_bytes": data.numel() * data.element_size(),
                 "rss_bytes": None}]
    return [{"rank": s.rank, "weight_bytes": s.weight_bytes, "kv_cache_bytes": s.kv_cache_bytes, "rss_bytes": rss,
             "expert_load": s.expert_load} for s, rss in zip(executor.rank_stats(), executor.rank_rss_bytes())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-blocks", type=int, default=128)
    parser.add_argument("--moe-hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=1024)
    parser.add_argument("--moe-layers", type=int, default=8)
    args = parser.parse_args()

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.loader import load_model
    from tandem.engine.parallel import ParallelConfig

    torch.set_num_threads(min(2, torch.get_num_threads()))
    config = EngineConfig(num_kv_blocks=args.kv_blocks, enable_prefix_caching=False)
    embedded = load_model(progress=False, device=args.device)
    tokenizer = embedded.tokenizer
    prompts = [tokenizer.encode(QUESTION.format(i=i)) for i in range(args.concurrency)]
    moe_dir = write_moe(Path(tempfile.mkdtemp(prefix="tandem-bench-moe-")), args, tokenizer)

    layouts = {  # name -> (model path or None for the embedded, ParallelConfig)
        "dense tp=1": (None, ParallelConfig()), "dense tp=2": (None, ParallelConfig(tp=2)),
        "dense pp=2": (None, ParallelConfig(pp=2)),
        "moe ep=1": (moe_dir, ParallelConfig()), "moe ep=2": (moe_dir, ParallelConfig(ep=2)),
    }
    engines = {}
    for name, (path, parallel) in layouts.items():
        print(f"starting {name} ...", file=sys.stderr, flush=True)
        loaded = load_model(path, progress=False, device=args.device, weights=parallel.world_size == 1)
        engines[name] = LLMEngine(loaded, config, parallel=parallel)
    results: dict[str, dict] = {name: {"runs": []} for name in layouts}
    try:
        for name, engine in engines.items():  # warm-up: first touch of KV pages and weights
            decode_run(engine, prompts[:4], 4)
        for r in range(args.rounds):
            for name, engine in engines.items():
                run = decode_run(engine, prompts, args.tokens)
                results[name]["runs"].append(run)
                print(f"round {r + 1} {name}: {run['decode_tokens_per_s']:.1f} decode tok/s", file=sys.stderr,
                      flush=True)
        for name, engine in engines.items():
            results[name]["memory"] = memory(engine)
    finally:
        for engine in engines.values():
            engine.shutdown()

    summary = {}
    for name, data in results.items():
        rate = statistics.median(run["decode_tokens_per_s"] for run in data["runs"])
        last = data["runs"][-1]["ranks"]
        entry = {"decode_tokens_per_s": rate, "ratio_vs_one_process": None, "memory": data["memory"],
                 "collective_share": [round(r["collective_share"], 3) for r in last],
                 "idle_share": [round(r["idle_share"], 3) for r in last]}
        parallel = layouts[name][1]
        if parallel.pp > 1:
            # The bubble: the share of the window a stage sits outside its forward, beyond what one process
            # spends outside the model (scheduling, sampling) in the same run.
            peer_idle = statistics.mean(r["idle_share"] for r in results["dense tp=1"]["runs"][-1]["ranks"])
            entry["bubble"] = round(statistics.mean(r["idle_share"] for r in last) - peer_idle, 3)
            m = parallel.num_micro_batches
            entry["gpipe_bubble_bound"] = round((parallel.pp - 1) / (m + parallel.pp - 1), 3)
        summary[name] = entry
    for name, entry in summary.items():
        peer = "dense tp=1" if name.startswith("dense") else "moe ep=1"
        entry["ratio_vs_one_process"] = entry["decode_tokens_per_s"] / summary[peer]["decode_tokens_per_s"]
        mem = ", ".join(f"r{m['rank']} {m['weight_bytes'] / 2**20:.0f}+{m['kv_cache_bytes'] / 2**20:.0f} MiB"
                        + (f" (RSS {m['rss_bytes'] / 2**20:.0f})" if m["rss_bytes"] else "") for m in entry["memory"])
        extra = f"; collectives {entry['collective_share']} of step time"
        if "bubble" in entry:
            extra += f"; bubble {entry['bubble']} (GPipe bound {entry['gpipe_bubble_bound']})"
        print(f"{name:12s} {entry['decode_tokens_per_s']:7.1f} tok/s ({entry['ratio_vs_one_process']:.2f}x one "
              f"process); weights+KV per rank: {mem}{extra}")
    print(json.dumps({"device": args.device, "concurrency": args.concurrency, "tokens": args.tokens,
                      "rounds": args.rounds, "layouts": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
