"""Batch-1 decode speed of tandem vs transformers on the same model and prompts, against the memory roofline.

A batch-1 decode step must read every weight once, so tokens/s can never beat
    read bandwidth / weight bytes read per token.
This script measures, in one run: the machine's read bandwidth (a large torch reduction), tandem's and
transformers' decode tokens/s on the same prompts (greedy, fixed length), and reports each one's fraction of
the roofline and tandem's speed-up over transformers. With --profile it also prints where tandem's time goes.

    .venv/bin/python bench/decode_roofline.py [--tokens 64] [--threads 2] [--dtypes float32,bfloat16]

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

PROMPTS = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "Explain how a hash map works, with an example in Python."}],
    [{"role": "user", "content": "Quels sont les avantages du train par rapport à l'avion ?"}],
]


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (sum of a tensor far larger than the caches), best of `repeats`."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def decode_rate(run, prompts, tokens: int) -> float:
    """Decode tokens/s from two timed runs per prompt: (tokens - 1) / (time(tokens) - time(1)).
    Subtracting the 1-token run removes prefill and per-request set-up from both systems alike."""
    run(prompts[0], 2)  # warm-up
    full = one = 0.0
    for ids in prompts:
        start = time.perf_counter()
        run(ids, 1)
        one += time.perf_counter() - start
        start = time.perf_counter()
        run(ids, tokens)
        full += time.perf_counter() - start
    return len(prompts) * (tokens - 1) / (full - one)


def tandem_runner(dtype: torch.dtype):
    from tandem.engine.generator import Generator
    from tandem.engine.loader import load_model
    from tandem.engine.sampling_params import SamplingParams

    loaded = load_model(dtype=dtype, progress=False)
    generator = Generator(loaded, max_model_len=2048)

    def run(ids, n):
        out = generator.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == n
        return out.token_ids

    return loaded, generator, run


def transformers_runner(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from tandem.engine.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()

    @torch.inference_mode()
    def run(ids, n):
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        return out[0, len(ids):].tolist()

    return run


def profile_tandem(generator, ids, tokens: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    from tandem.engine.sampling_params import SamplingParams

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generator.generate(ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    results = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "threads": args.threads,
               "tokens": args.tokens, "prompts": len(PROMPTS), "read_bandwidth_gbps": bandwidth / 1e9, "runs": {}}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        loaded, generator, run = tandem_runner(dtype)
        prompts = [loaded.tokenizer.encode_chat(p) for p in PROMPTS]
        per_token = loaded.model.weight_bytes_per_token()
        roofline = bandwidth / per_token
        tandem_tps = decode_rate(run, prompts, args.tokens)
        hf_tps = decode_rate(transformers_runner(dtype), prompts, args.tokens)
        hf_bytes = per_token  # same weights, same dtype: the same bytes must be read
        run_result = {
            "weight_bytes_per_token": per_token,
            "roofline_tokens_per_s": roofline,
            "tandem_tokens_per_s": tandem_tps,
            "transformers_tokens_per_s": hf_tps,
            "speedup_vs_transformers": tandem_tps / hf_tps,
            "tandem_roofline_fraction": tandem_tps / roofline,
            "transformers_roofline_fraction": hf_tps * hf_bytes / bandwidth,
        }
        results["runs"][name] = run_result
        print(f"{name}: tandem {tandem_tps:.1f} tok/s, transformers {hf_tps:.1f} tok/s "
              f"({run_result['speedup_vs_transformers']:.2f}x), roofline {roofline:.1f} tok/s "
              f"(tandem at {100 * run_result['tandem_roofline_fraction']:.0f}%)", file=sys.stderr)
        if args.profile:
            print(profile_tandem(generator, prompts[0], 16), file=sys.stderr)
        del loaded, generator, run
    print(json.dumps(results))


if __name__ == "__main__":
    main()
