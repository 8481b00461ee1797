"""Many LoRA adapters in one batch against the base model, on this machine (issue 47's target: at most 1.3x).

The same C concurrent requests (distinct prompts, --tokens greedy tokens each, ignore_eos) run through one engine
twice per round, in alternating order: every request on the base model, then request i under adapter i mod A (A
adapters of rank R on all seven projections, random weights written in PEFT's format: the values do not change
the cost). The ratio is LoRA wall time over base wall time, median over rounds (lower is better; the target is
<= 1.3 at 32 requests over 8 adapters of rank 16). Also: the seconds to load one adapter (registering it checks
its headers; a rank reads its weights when a step first needs it: both timed), and how many times the runner read
adapters into its pool. --compile off runs both eager (the default is the engine's, where base decode steps are
compiled and steps with LoRA rows are not).

    .venv/bin/python bench/lora.py [--requests 32] [--adapters 8] [--rank 16] [--tokens 32] [--rounds 3]
    .venv/bin/python bench/lora.py --device cuda

The last line of output is one JSON object with every number.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.engine_throughput import prompts  # noqa: E402
from bench.machine import cpu_report, embedded_on, machine_line  # noqa: E402


def run(engine, requests: list[list[int]], adapters: list[str | None], tokens: int) -> float:
    """Seconds from the first add to the last token of every request."""
    from tandem.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, (ids, adapter) in enumerate(zip(requests, adapters)):
        engine.add_request(f"{engine.num_steps}-{i}", ids, SamplingParams(max_tokens=tokens, temperature=0,
                                                                        ignore_eos=True, lora=adapter))
    while engine.has_unfinished_requests():
        engine.step()
    if engine.loaded.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", default="auto", choices=["auto", "off"],
                        help="auto: the engine's default (compiled base decode steps); off: both eager")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig, LoRAConfig
    from tandem.engine.loader.lora_adapter import read_adapter, write_random_adapter

    loaded, dtype = embedded_on(args.device)
    config = EngineConfig(kv_cache_bytes=512 << 20, max_num_seqs=max(64, args.requests),
                          compile=False if args.compile == "off" else None,
                          lora=LoRAConfig(max_rank=args.rank, max_loaded=args.adapters))
    requests = prompts(loaded.tokenizer, args.requests)
    names = [f"adapter{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp, LLMEngine(loaded, config) as engine:
        load_s, read_s = [], []
        for i, name in enumerate(names):
            folder = write_random_adapter(Path(tmp) / name, loaded.config, args.rank, seed=i)
            load_s.append(engine.load_lora(name, str(folder)))  # registration: its headers checked
            start = time.perf_counter()
            read_adapter(folder, name, loaded.config, args.rank)  # what a rank reads when a step first needs it
            read_s.append(time.perf_counter() - start)
        modes = {"base": [None] * args.requests, "lora": [names[i % args.adapters] for i in range(args.requests)]}
        run(engine, requests, modes["lora"], 2)  # warm-up: the pool reads every adapter, kernels start
        run(engine, requests, modes["base"], 2)
        times: dict[str, list[float]] = {name: [] for name in modes}
        for r in range(args.rounds):
            for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                times[mode].append(run(engine, requests, modes[mode], args.tokens))
            print(f"round {r + 1}: base {times['base'][-1]:.2f} s, lora {times['lora'][-1]:.2f} s "
                  f"({times['lora'][-1] / times['base'][-1]:.2f}x)", file=sys.stderr, flush=True)
        loads = engine.executor.runner.lora.loads if hasattr(engine.executor, "runner") else None
    ratio = statistics.median(lo / b for lo, b in zip(times["lora"], times["base"]))
    produced = args.requests * args.tokens
    print(f"{args.requests} requests over {args.adapters} adapters of rank {args.rank}: {ratio:.2f}x the base "
          f"model's time (target <= 1.3); loading one adapter: {statistics.median(load_s):.4f} s to check it, "
          f"{statistics.median(read_s):.4f} s to read it", file=sys.stderr)
    report = {"bench": "lora", "machine": machine_line(), "device": args.device, "dtype": dtype,
              **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {"cpu": cpu_report()}),
              "threads": args.threads, "requests": args.requests, "adapters": args.adapters, "rank": args.rank,
              "tokens": args.tokens, "rounds": args.rounds, "compile": args.compile,
              "tokens_per_s": {mode: round(produced / statistics.median(t), 1) for mode, t in times.items()},
              "lora_over_base_time": round(ratio, 3), "per_round": [round(lo / b, 3) for lo, b in
                                                                    zip(times["lora"], times["base"])],
              "load_s": {"median": round(statistics.median(load_s), 4), "max": round(max(load_s), 4)},
              "read_s": {"median": round(statistics.median(read_s), 4), "max": round(max(read_s), 4)},
              "pool_loads": loads, "target": 1.3, "target_met": ratio <= 1.3}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
