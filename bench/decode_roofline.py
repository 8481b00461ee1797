"""Batch-1 decode speed of tandem vs transformers on the same model and prompts, against the memory roofline.

A batch-1 decode step must read every weight once, so tokens/s can never beat
    read bandwidth / weight bytes read per token.
This script measures, in interleaved rounds of one run: the machine's read bandwidth (a large torch reduction),
tandem's and transformers' decode tokens/s on the same prompts (greedy, fixed length); it reports medians,
each system's fraction of the roofline and tandem's speed-up over transformers. With --profile it also prints where tandem's time goes
(and records each op's milliseconds per token and share of the step under `profile`).

    .venv/bin/python bench/decode_roofline.py [--tokens 64] [--threads 2] [--modes float32,bfloat16,packed-int4]
    .venv/bin/python bench/decode_roofline.py --modes packed-int4 --llama-cpp   # after `make bench-peers`
    .venv/bin/python bench/decode_roofline.py --like Llama-3.2-1B --modes float32,bfloat16 --tokens 16

--model PATH / --like NAME measure another model (bench/model_choice.py): a published shape runs with dummy weights
against transformers built from the same config with its own random weights (speed does not depend on the values).

Modes: float32 and bfloat16 expand every weight (the peer is transformers in the same dtype); packed-int4
keeps the GGUF's Q4_1 weights 4-bit (bfloat16 compute; the peer is transformers in bfloat16, which expands
them: its bytes per token are counted from its own tensors). Each mode runs on the kernels the CPU probe chose
(recorded per mode as `tandem_kernels`, with the probe under `cpu`); a mode that fails on this machine is
recorded with its error instead of numbers, and the others still run. To measure an AVX2 CPU's paths on an
AVX-512 machine, run with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.

--llama-cpp adds llama.cpp's batch-1 decode of the same GGUF file (bench/peers/llama_cpp_peer.py, the same threads and
method, in a process of its own) to every round: the laptop user's alternative, reported as `speedup_vs_llama_cpp`.

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

PROMPTS = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "Explain how a hash map works, with an example in Python."}],
    [{"role": "user", "content": "Quels sont les avantages du train par rapport à l'avion ?"}],
]


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
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
    run(max(prompts, key=len), tokens)  # warm-up: touches every KV page and weight page a timed run will
    full = one = 0.0
    for ids in prompts:
        start = time.perf_counter()
        run(ids, 1)
        one += time.perf_counter() - start
        start = time.perf_counter()
        run(ids, tokens)
        full += time.perf_counter() - start
    return len(prompts) * (tokens - 1) / (full - one)


# mode -> (tandem load_model arguments, dtype of the transformers peer)
MODES = {
    "float32": ({"dtype": torch.float32}, torch.float32),
    "bfloat16": ({"dtype": torch.bfloat16}, torch.bfloat16),
    "packed-int4": ({"dtype": torch.bfloat16, "weight_format": "packed"}, torch.bfloat16),
}


def tandem_runner(choice: ModelChoice, load_args: dict):
    from tandem.engine.core.generator import Generator
    from tandem.engine.loader import load_model
    from tandem.engine.sampling_params import SamplingParams

    loaded = load_model(**choice.load_args(), progress=False, **load_args)
    generator = Generator(loaded, max_model_len=2048)

    def run(ids, n):
        out = generator.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == n
        return out.token_ids

    return loaded, generator, run


def transformers_runner(choice: ModelChoice, dtype: torch.dtype):
    model = choice.transformers_model(dtype)

    @torch.inference_mode()
    def run(ids, n):
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        return out[0, len(ids):].tolist()

    # What its decode step reads: every distinct parameter and buffer (packed GGUF weights included; rotary
    # tables are a few KB). Tied embeddings share storage and count once.
    seen, nbytes = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            nbytes += t.untyped_storage().nbytes()
    return run, nbytes


def gguf_bytes_per_token(path) -> int:
    """Bytes of the GGUF file's tensors a batch-1 step reads: every one, the token embedding as the (tied) LM head
    and not again for its one-row lookup. What llama.cpp reads per token of this file."""
    from tandem.engine.loader.gguf_index import open_gguf

    return sum(t.n_bytes for t in open_gguf(path).tensors)


def profile_tandem(generator, ids, tokens: int) -> tuple[str, dict]:
    """Where a decode of `tokens` tokens spends its time, by op (torch's profiler, self time): the table, and the
    ops' milliseconds per token and shares of the whole (the 12 largest, the rest summed as "other")."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.engine.sampling_params import SamplingParams

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generator.generate(ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1
    shares = {e.key: {"ms_per_token": e.self_cpu_time_total / 1e3 / tokens, "share": e.self_cpu_time_total / total}
              for e in events[:12]}
    rest = sum(e.self_cpu_time_total for e in events[12:])
    shares["other"] = {"ms_per_token": rest / 1e3 / tokens, "share": rest / total}
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (median is reported)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's batch-1 decode (make bench-peers)")
    add_model_arguments(parser)
    args = parser.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    args.choice = model_choice(args)
    if args.llama_cpp and args.choice.path is not None:
        parser.error("--llama-cpp runs the embedded GGUF file: drop --model / --like")

    results = {"machine": machine_line(), "cpu": cpu_report(), "model": args.choice.label, "threads": args.threads,
               "tokens": args.tokens,
               "prompts": len(PROMPTS), "rounds": args.rounds, "runs": {}}
    peers: dict[torch.dtype, tuple] = {}
    for name in args.modes.split(","):
        try:
            results["runs"][name] = measure_mode(name, args, peers)
        except Exception as e:  # noqa: BLE001 - a mode this machine cannot run is a result, not a crash
            results["runs"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: cannot run here: {type(e).__name__}: {e}", file=sys.stderr)
    print(json.dumps(results))


def measure_mode(name: str, args: argparse.Namespace, peers: dict) -> dict:
    """One mode's numbers (see the module docstring); `peers` caches the transformers runner per dtype."""
    load_args, peer_dtype = MODES[name]
    loaded, generator, run = tandem_runner(args.choice, load_args)
    prompts = [loaded.tokenizer.encode_chat(p) for p in PROMPTS]
    per_token = loaded.model.weight_bytes_per_token()
    if peer_dtype not in peers:
        peers[peer_dtype] = transformers_runner(args.choice, peer_dtype)
    hf_run, hf_bytes = peers[peer_dtype]
    llama = None
    if args.llama_cpp:
        from bench.peers import llama_cpp_peer as llama_cpp

        # in a process of its own each round (bench/peers/llama_cpp_peer.py: its spinning threads and torch's)
        llama = lambda: llama_cpp.measure("batch1", prompts, args.tokens, args.threads)["tokens_per_s"]  # noqa: E731
    # This machine's speed drifts (shared host): interleave the systems and the bandwidth probe, and
    # report medians over rounds, so a ratio compares measurements taken seconds apart.
    rounds = [(read_bandwidth(gib=0.5, repeats=3), decode_rate(run, prompts, args.tokens),
               decode_rate(hf_run, prompts, args.tokens), llama() if llama else None) for _ in range(args.rounds)]
    bw = statistics.median(r[0] for r in rounds)
    tandem_tps = statistics.median(r[1] for r in rounds)
    hf_tps = statistics.median(r[2] for r in rounds)
    run_result = {
        "tandem_kernels": loaded.model.kernel_counts(),
        "read_bandwidth_gbps": bw / 1e9,
        "tandem_weight_bytes_per_token": per_token,
        "tandem_roofline_tokens_per_s": bw / per_token,
        "tandem_tokens_per_s": tandem_tps,
        "tandem_roofline_fraction": statistics.median(r[1] * per_token / r[0] for r in rounds),
        "transformers_dtype": str(peer_dtype).removeprefix("torch."),
        "transformers_weight_bytes_per_token": hf_bytes,
        "transformers_tokens_per_s": hf_tps,
        "transformers_roofline_fraction": statistics.median(r[2] * hf_bytes / r[0] for r in rounds),
        "speedup_vs_transformers": statistics.median(r[1] / r[2] for r in rounds),
        "speedup_per_round": [r[1] / r[2] for r in rounds],
    }
    if name == "packed-int4" and args.choice.path is None:
        from tandem.engine.loader import default_model_path

        gguf = gguf_bytes_per_token(default_model_path())
        run_result["gguf_bytes_per_token"] = gguf
        run_result["tandem_roofline_fraction_of_gguf_bytes"] = statistics.median(r[1] * gguf / r[0] for r in rounds)
    if llama:
        run_result["llama_cpp_tokens_per_s"] = statistics.median(r[3] for r in rounds)
        run_result["speedup_vs_llama_cpp"] = statistics.median(r[1] / r[3] for r in rounds)
        print(f"{name}: llama.cpp (the GGUF file as it is) {run_result['llama_cpp_tokens_per_s']:.1f} tok/s; "
              f"tandem {run_result['speedup_vs_llama_cpp']:.2f}x", file=sys.stderr)
    print(f"{name}: tandem {tandem_tps:.1f} tok/s ({per_token / 1e6:.0f} MB/token, "
          f"{100 * run_result['tandem_roofline_fraction']:.0f}% of roofline); transformers {peer_dtype} "
          f"{hf_tps:.1f} tok/s ({hf_bytes / 1e6:.0f} MB/token); speed-up "
          f"{run_result['speedup_vs_transformers']:.2f}x (rounds: "
          f"{', '.join(f'{x:.2f}' for x in run_result['speedup_per_round'])})", file=sys.stderr)
    if args.profile:
        table, run_result["profile"] = profile_tandem(generator, prompts[0], args.tokens)
        print(table, file=sys.stderr)
    return run_result


if __name__ == "__main__":
    main()
