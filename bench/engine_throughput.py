"""Engine throughput under concurrency vs transformers run sequentially, and the prefix cache's TTFT gain.

Throughput: C requests (C = 1, 8, 32, 64 by default) enter the engine at once; each has its own prompt (a fixed
question behind a distinct request number, so no prefix is shared and the cache cannot help) and generates
--tokens tokens greedily with ignore_eos. Output tokens/s = all generated tokens / wall time from the first add
to the last token, after one untimed warm-up run of the largest level. Two peers, transformers `generate` on the
same model, dtype and requests in the same run: one request at a time (the first --hf-requests of them), and
static batching (the largest level's requests left-padded into one batch, one `generate` call).

Prefix cache: a 500-token system prompt shared by every request. TTFT (add -> first token) of a request whose
system prompt is cached vs the same request on a cold cache, alternating, median over --ttft-rounds.

    .venv/bin/python bench/engine_throughput.py [--concurrency 1,8,32,64] [--tokens 64] [--dtype float32]
    .venv/bin/python bench/engine_throughput.py --device cuda      # bfloat16 unless --dtype says otherwise
    .venv/bin/python bench/engine_throughput.py --like Llama-3.2-1B --concurrency 1,32 --tokens 16
    .venv/bin/python bench/engine_throughput.py --weights packed --concurrency 1,8 --llama-cpp   # the laptop path

--model PATH / --like NAME measure another model (bench/model_choice.py): a published shape runs with dummy weights
against transformers built from the same config with its own random weights (speed does not depend on the values).

The JSON names the machine, the CPU probe (`cpu`) and the kernels the projections ran on (`tandem_kernels`); a
dtype this machine cannot run is reported with its error instead of numbers. To measure an AVX2 CPU's paths on
an AVX-512 machine, run with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.

--device cuda runs the engine and the transformers peer on the GPU (both in --dtype, bfloat16 by default there),
synchronizes the device around every timed span, gives each engine an explicit KV budget (the two engines and the
peer share the GPU), and names the GPU (`gpu`, torch.cuda.get_device_name) instead of the CPU probe.

--llama-cpp adds llama.cpp's batched decode of the largest level's requests on the same GGUF file (one context,
a sequence each; bench/peers/llama_cpp_peer.py in a process of its own, after `make bench-peers`) to every round,
reported as `speedup_vs_llama_cpp_batched` (tandem float32 or bfloat16 against llama.cpp on the file's own Q4_1 weights).
--weights packed runs tandem on the GGUF file's own 4-bit weights too (bfloat16 compute; its transformers peers in
bfloat16, which expands them).

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
from bench.model_choice import ModelChoice, add_model_arguments, model_choice  # noqa: E402

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works, with an example in Python.",
    "What are the advantages of trains over planes?",
    "Give me three tips for learning a new language.",
]
SYSTEM_SENTENCE = ("You are a meticulous assistant for a logistics company: answer in plain English, cite the "
                   "relevant policy section, prefer metric units, and ask a clarifying question when needed. ")


def prompts(tokenizer, count: int, length: int | None = None) -> list[list[int]]:
    """count distinct chat prompts (a request number, then a question); with length, each made exactly that many
    tokens long (the question's text repeated after it, cut at length)."""
    found = []
    filler = tokenizer.encode(" " + SYSTEM_SENTENCE)
    for i in range(count):
        ids = tokenizer.encode_chat([{"role": "user", "content": f"Request {i}. {QUESTIONS[i % len(QUESTIONS)]}"}])
        if length is not None:
            ids = (ids + filler * (length // len(filler) + 1))[:length]
        found.append(ids)
    return found


CUDA_KV_CACHE_BYTES = 4 << 30  # each engine's on the GPU: without it the first would take 90% of the free memory


def sync(device: str) -> None:
    """Waits for the device's queued work (a no-op on the CPU), so that a timed span ends when its work does."""
    if device == "cuda":
        torch.cuda.synchronize()


def engine_tokens_per_s(engine, requests: list[list[int]], tokens: int, device: str = "cpu") -> dict:
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    for i, ids in enumerate(requests):
        engine.add_request(f"r{i}-{start}", ids, params)
    generated = 0
    steps = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    sync(device)
    elapsed = time.perf_counter() - start
    if generated != tokens * len(requests):
        raise RuntimeError(f"expected {tokens * len(requests)} tokens, got {generated}")
    return {"tokens_per_s": generated / elapsed, "seconds": elapsed, "steps": steps}


def transformers_runner(choice: ModelChoice, dtype: torch.dtype, device: str = "cpu"):
    model = choice.transformers_model(dtype, device)

    @torch.inference_mode()
    def static(requests: list[list[int]], tokens: int) -> dict:
        """All requests as one left-padded batch: transformers' static batching."""
        width = max(len(ids) for ids in requests)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in requests], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in requests], device=device)
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)
        sync(device)
        elapsed = time.perf_counter() - start
        assert out.shape == (len(requests), width + tokens)
        return {"tokens_per_s": tokens * len(requests) / elapsed, "seconds": elapsed, "requests": len(requests)}

    @torch.inference_mode()
    def run(requests: list[list[int]], tokens: int) -> dict:
        sync(device)
        start = time.perf_counter()
        for ids in requests:
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=0)
            assert out.shape[1] - len(ids) == tokens
        sync(device)
        elapsed = time.perf_counter() - start
        return {"tokens_per_s": tokens * len(requests) / elapsed, "seconds": elapsed, "requests": len(requests)}

    run([[1, 2, 3]], 4)  # warm-up
    return run, static


def prefix_ttft(loaded, config_cls, engine_cls, rounds: int, device: str = "cpu") -> dict:
    """TTFT with the 500-token system prompt cached vs cold (the cache is reset before each cold run)."""
    from tandem.engine.sampling_params import SamplingParams

    tok = loaded.tokenizer
    system = tok.encode(SYSTEM_SENTENCE * 20)[:500]
    engine = engine_cls(loaded, config_cls(max_model_len=2048, max_num_batched_tokens=2048, **kv_budget(device)))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def ttft(i: int) -> float:
        ids = system + tok.encode(f" Question {i}: {QUESTIONS[i % len(QUESTIONS)]}")
        sync(device)
        start = time.perf_counter()
        engine.add_request(f"ttft{i}", ids, params)
        while not any(o.token_ids for o in engine.step()):
            pass
        sync(device)
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    ttft(-1)  # warm-up, and caches the system prompt
    cold, warm = [], []
    for i in range(rounds):
        engine.kv_manager.reset_prefix_cache()
        cold.append(ttft(2 * i))
        warm.append(ttft(2 * i + 1))  # the cold run just cached the system prompt
    return {"system_prompt_tokens": len(system), "cold_ttft_s": statistics.median(cold),
            "cached_ttft_s": statistics.median(warm),
            "ttft_speedup": statistics.median(c / w for c, w in zip(cold, warm)),
            "hit_rate": engine.stats().prefix_hit_rate}


def kv_budget(device: str, gib: float | None = None) -> dict:
    """EngineConfig's KV budget: the default (a fraction of free memory) on the CPU, a fixed one on the GPU
    (gib GiB, default CUDA_KV_CACHE_BYTES)."""
    if device != "cuda":
        return {}
    return {"kv_cache_bytes": int(gib * (1 << 30)) if gib else CUDA_KV_CACHE_BYTES}


def device_report(device: str) -> dict:
    """What the engine ran on: the CPU probe, or the GPU's name (and torch's CUDA version)."""
    if device == "cuda":
        return {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    return {"cpu": cpu_report()}


def main() -> None:
    from tandem.engine.hardware.device import default_dtype

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="make every prompt exactly this many tokens (default: short chat questions)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="the engine's KV budget on CUDA (default 4; the peer shares the GPU)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: float32 on the CPU, bfloat16 on CUDA")
    parser.add_argument("--weights", default="dense", choices=["dense", "packed"],
                        help="packed: the GGUF file's 4-bit layers as they are (bfloat16 compute)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-requests", type=int, default=4, help="requests transformers runs one by one")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (medians reported)")
    parser.add_argument("--ttft-rounds", type=int, default=5, help="0 skips the prefix-cache TTFT measurement")
    add_model_arguments(parser)
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's batched decode (make bench-peers)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"engine_throughput.py: --device cuda, but torch {torch.__version__} sees no CUDA device (a CPU "
                 "build of torch, or no driver); run on a machine with an NVIDIA GPU, or use --device cpu")
    args.dtype = args.dtype or ("bfloat16" if args.weights == "packed" else default_dtype(args.device))
    torch.set_num_threads(args.threads)
    args.choice = model_choice(args)
    if args.llama_cpp and args.choice.path is not None:
        parser.error("--llama-cpp runs the embedded GGUF file: drop --model / --like")
    results = {"machine": machine_line(), "device": args.device, "model": args.choice.label}
    results |= device_report(args.device)
    results |= {"dtype": args.dtype, "weights": args.weights, "threads": args.threads, "tokens": args.tokens,
                "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
                "hf_requests": args.hf_requests}
    try:
        results |= measure(args)
    except Exception as e:  # noqa: BLE001 - a dtype this machine cannot run is a result, not a crash
        results["error"] = f"{type(e).__name__}: {e}"
        print(f"{args.dtype} on {args.device}: cannot run here: {results['error']}", file=sys.stderr)
    print(json.dumps(results))


def measure(args: argparse.Namespace) -> dict:
    """Every number of the module docstring, for args.dtype on args.device."""
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.loader import load_model

    dtype = getattr(torch, args.dtype)
    device = args.device
    loaded = load_model(**args.choice.load_args(), progress=False, dtype=dtype, device=device,
                        weight_format=args.weights)
    levels = [int(c) for c in args.concurrency.split(",")]
    requests = prompts(loaded.tokenizer, max(levels), args.prompt_tokens)
    longest = max(map(len, requests)) + args.tokens
    engine = LLMEngine(loaded, EngineConfig(max_model_len=max(2048, longest), max_num_seqs=max(levels),
                                            max_num_batched_tokens=2048, enable_prefix_caching=False,
                                            **kv_budget(device, args.kv_cache_gib)))
    # Warm-up: the largest level once, so that every KV block the timed runs use has been written before. On
    # a VM the first write to a page costs a host page fault, a one-time cost a long-running server never pays
    # again; the timed runs measure the steady state.
    engine_tokens_per_s(engine, requests[:max(levels)], args.tokens, device)
    hf_run, hf_static = transformers_runner(args.choice, dtype, device)
    llama = None
    if args.llama_cpp:
        from bench.peers import llama_cpp_peer as llama_cpp

        # in a process of its own each round (bench/peers/llama_cpp_peer.py: its spinning threads and torch's)
        llama = lambda: llama_cpp.measure("batched", requests[:max(levels)], args.tokens, args.threads)  # noqa: E731
    # This machine's speed drifts (shared host): each round measures every level and the peer back to back, and
    # the reported numbers are medians over rounds (speed-ups: median of the per-round ratios).
    rounds = []
    for r in range(args.rounds):
        row = {str(level): engine_tokens_per_s(engine, requests[:level], args.tokens, device) for level in levels}
        row["transformers"] = hf_run(requests[:args.hf_requests], args.tokens)
        row["transformers_static"] = hf_static(requests[:max(levels)], args.tokens)
        if llama:
            row["llama_cpp_batched"] = {k: v for k, v in llama().items() if k != "token_ids"}
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k}: {v['tokens_per_s']:.1f} tok/s" for k, v in row.items()),
              file=sys.stderr)
    results = {"tandem_kernels": loaded.model.kernel_counts(), "engine_tokens_per_s": {},
               "speedup_vs_transformers": {}, "speedup_per_round": {}}
    results["transformers_sequential_tokens_per_s"] = statistics.median(
        row["transformers"]["tokens_per_s"] for row in rounds)
    results["transformers_static_tokens_per_s"] = statistics.median(
        row["transformers_static"]["tokens_per_s"] for row in rounds)
    top = str(max(levels))
    results["speedup_vs_transformers_static"] = statistics.median(
        row[top]["tokens_per_s"] / row["transformers_static"]["tokens_per_s"] for row in rounds)
    if llama:
        results["llama_cpp_batched_tokens_per_s"] = statistics.median(
            row["llama_cpp_batched"]["tokens_per_s"] for row in rounds)
        results["speedup_vs_llama_cpp_batched"] = statistics.median(
            row[top]["tokens_per_s"] / row["llama_cpp_batched"]["tokens_per_s"] for row in rounds)
    for level in map(str, levels):
        results["engine_tokens_per_s"][level] = statistics.median(row[level]["tokens_per_s"] for row in rounds)
        ratios = [row[level]["tokens_per_s"] / row["transformers"]["tokens_per_s"] for row in rounds]
        results["speedup_per_round"][level] = ratios
        results["speedup_vs_transformers"][level] = statistics.median(ratios)
    print("tandem tok/s: " + ", ".join(f"{k} concurrent {v:.1f}" for k, v in results["engine_tokens_per_s"].items())
          + f"; transformers sequential {results['transformers_sequential_tokens_per_s']:.1f}", file=sys.stderr)
    print("speed-up vs transformers (median of rounds): " + ", ".join(
        f"{k}: {v:.1f}x" for k, v in results["speedup_vs_transformers"].items()), file=sys.stderr)
    print(f"{top} concurrent vs transformers static batching of the same {top} requests "
          f"({results['transformers_static_tokens_per_s']:.1f} tok/s): "
          f"{results['speedup_vs_transformers_static']:.2f}x", file=sys.stderr)
    if llama:
        print(f"{top} concurrent vs llama.cpp batched decode of the same {top} requests "
              f"({results['llama_cpp_batched_tokens_per_s']:.1f} tok/s): "
              f"{results['speedup_vs_llama_cpp_batched']:.2f}x", file=sys.stderr)
    del engine
    if args.ttft_rounds < 1:
        return results
    results["prefix_cache"] = prefix = prefix_ttft(loaded, EngineConfig, LLMEngine, args.ttft_rounds, device)
    print(f"500-token system prompt: TTFT cold {prefix['cold_ttft_s'] * 1e3:.0f} ms, cached "
          f"{prefix['cached_ttft_s'] * 1e3:.0f} ms ({prefix['ttft_speedup']:.1f}x)", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
