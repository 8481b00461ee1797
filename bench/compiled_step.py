"""The compiled decode step against eager, in one run: the same model, two engines, interleaved rounds.

For each batch size, each engine is given that many requests (the same chat prompts, greedy), steps until every
one has its first token, then times the next --steps decode steps, all decode-only batches of that size. It
reports ms per step and tokens/s for each engine, the speed-up, how long warm-up compilation took and whether
the greedy tokens of the two engines agreed.

    .venv/bin/python bench/compiled_step.py [--batches 1,8,64] [--steps 24] [--rounds 3] [--threads 2]
    .venv/bin/python bench/compiled_step.py --device cuda [--dtype float32]   # CUDA graphs against eager launches

On --device cuda (bfloat16 unless --dtype says otherwise) the "compiled" engine is the one whose decode step replays
piecewise CUDA graphs (engine/models/cuda_graphs.py), and compile_s is their capture at start-up.

Compile time depends on inductor's cache (engine/models/compiled.py): the first run on a machine compiles (about a
minute for the embedded model on 2 cores), later runs read the cache; `compile_s` reports what this run took.
The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import cpu_report, machine_line  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works, with an example in Python.",
    "Quels sont les avantages du train par rapport à l'avion ?",
    "List five uses of copper and explain each briefly.",
]


def step_times(engine, prompts: list[list[int]], steps: int, params=None) -> tuple[float, list[list[int]]]:
    """Seconds per decode step with len(prompts) sequences, and each request's tokens. params: every request's
    SamplingParams (default: greedy, ignore_eos, steps + 2 tokens); they must let each request run steps + 1
    tokens."""
    from tandem.engine.sampling_params import SamplingParams

    params = params or SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    stamp = time.perf_counter_ns()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}-{stamp}", ids, params)
    tokens: dict[str, list[int]] = {f"r{i}-{stamp}": [] for i in range(len(prompts))}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)

    while any(not t for t in tokens.values()):  # prefill (chunks) until every request has its first token
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        step()
    return elapsed / steps, list(tokens.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: float32 on the CPU, bfloat16 on CUDA")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.hardware.device import default_dtype
    from tandem.engine.loader import load_model

    args.dtype = args.dtype or default_dtype(args.device)
    loaded = load_model(progress=False, device=args.device, dtype=getattr(torch, args.dtype))
    tok = loaded.tokenizer
    chats = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]

    def engine(compile_step: bool) -> LLMEngine:
        return LLMEngine(loaded, EngineConfig(max_model_len=2048, max_num_seqs=max(batches),
                                              max_num_batched_tokens=4096, kv_cache_bytes=512 << 20,
                                              enable_prefix_caching=False, compile=compile_step))

    start = time.perf_counter()
    compiled = engine(True)
    compile_s = time.perf_counter() - start
    if compiled.executor.runner.compiled is None:
        raise SystemExit("the decode step did not compile on this machine (see the log)")
    eager = engine(False)
    results: dict[str, dict] = {}
    for b in batches:
        prompts = [chats[i % len(chats)] for i in range(b)]
        ms: dict[str, list[float]] = {"compiled": [], "eager": []}
        same = True
        for _ in range(args.rounds):
            c, c_tokens = step_times(compiled, prompts, args.steps)
            e, e_tokens = step_times(eager, prompts, args.steps)
            ms["compiled"].append(c * 1e3)
            ms["eager"].append(e * 1e3)
            same &= c_tokens == e_tokens
        med = {k: statistics.median(v) for k, v in ms.items()}
        results[str(b)] = {
            "ms_per_step": {k: round(v, 2) for k, v in med.items()},
            "tokens_per_s": {k: round(b * 1e3 / v, 1) for k, v in med.items()},
            "speedup": round(med["eager"] / med["compiled"], 3),
            "per_round_speedup": [round(e / c, 3) for c, e in zip(ms["compiled"], ms["eager"])],
            "greedy_tokens_equal": same,
        }
        print(f"batch {b}: compiled {med['compiled']:.2f} ms/step, eager {med['eager']:.2f} ms/step, "
              f"{results[str(b)]['speedup']}x, tokens equal: {same}", file=sys.stderr)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    print(json.dumps({"bench": "compiled_step", "machine": machine_line(), "cpu": cpu_report(), "device": args.device,
                      "gpu": gpu, "dtype": args.dtype, "decode_step": compiled.rank_placements[0].decode_step,
                      "threads": args.threads, "steps": args.steps, "rounds": args.rounds,
                      "compile_s": round(compile_s, 1), "compiled_graphs": compiled.executor.runner.compiled.compiles,
                      "fallback_steps": compiled.executor.runner.compiled.fallbacks, "batches": results}))


if __name__ == "__main__":
    main()
