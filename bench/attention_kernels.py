"""The Triton attention kernels against the torch reference backend and against the floor of their shapes.

Decode (paged, split-K): batch x context tokens of KV read once; floor = KV bytes / measured memory bandwidth
(a large device-to-device copy). Prefill (paged, causal, over cached context): floor = attention FLOPs / measured
matmul rate (a large bf16 matmul on CUDA, fp32 on the CPU). On CUDA each time is Triton's do_bench (CUDA events
over many calls, L2 flushed, median); on the CPU the median of --rounds after a warm-up. The reference is
TorchAttentionBackend on the same inputs. The decode kernel is also timed alone at 1, 2, 4 and 8 splits
(by_splits), and each kernel's autotuning candidates are listed with their times (candidates_ms).

The JSON's headline numbers: decode_fraction_of_bandwidth (KV bytes read per second over the copy bandwidth) and
prefill_fraction_of_matmul (attention FLOP/s over the matmul rate), against TARGETS; targets_met says whether
each reaches its target (null under the interpreter, whose times say nothing about speed).

    .venv/bin/python bench/attention_kernels.py                    # CUDA: batch 64 x 4k decode, 8k prefill
    TRITON_INTERPRET=1 .venv/bin/python bench/attention_kernels.py --small   # CPU: the interpreter, tiny shapes

On the CPU the kernels run in Triton's interpreter: its times say nothing about speed (the JSON says so), only
that the benchmark runs end to end. The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

TARGETS = {"decode": 0.70, "prefill": 0.50}  # fractions of the bandwidth and matmul floors on a GPU


def timed(fn, rounds: int, device: torch.device) -> float:
    """Seconds per call of fn: on CUDA, Triton's do_bench (CUDA events over many calls, the L2 cache flushed before
    each, the median), so that launch gaps and a single call's noise stay out of kernels of a fraction of a ms;
    elsewhere the median of `rounds` timed calls after a warm-up."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=max(100, 40 * rounds), return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(device: torch.device, rounds: int) -> float:
    """Bytes/s of a large copy (read + write)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), rounds, device)


def matmul_rate(device: torch.device, dtype: torch.dtype, rounds: int) -> float:
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, rounds, device)


def split_sweep(q, kv, meta, scale, kv_bytes, bw, rounds, device) -> dict:
    """The decode kernel alone (no KV write) at 1, 2, 4 and 8 splits per sequence, and the split count the backend
    chooses (choose_splits): fraction of the bandwidth floor for each, to show what the split heuristic costs."""
    from tandem.engine.attention.triton_decode import choose_splits, paged_decode_attention

    sweep = {"chosen": choose_splits(q.shape[0], kv.shape[2], meta.block_tables.shape[1])}
    for splits in (1, 2, 4, 8):
        t = timed(lambda: paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens_tensor, scale,
                                                 num_splits=splits), rounds, device)
        sweep[str(splits)] = {"s": t, "fraction_of_bandwidth": kv_bytes / t / bw}
    return sweep


def paged_batch(lens_done, query_lens, heads, kv_heads, head_dim, block_size, dtype, device):
    from tandem.engine.attention import AttentionMetadata

    totals = [q + c for q, c in zip(query_lens, lens_done)]
    needed = [-(-t // block_size) for t in totals]
    perm = torch.randperm(sum(needed)).tolist()
    tables, i = [], 0
    for n in needed:
        tables.append(perm[i:i + n])
        i += n
    kv = torch.randn(2, sum(needed), kv_heads, block_size, head_dim, device=device, dtype=dtype)
    meta = AttentionMetadata.build(query_lens, lens_done, tables, block_size, device)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(t, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(t, kv_heads, head_dim, device=device, dtype=dtype)
    return kv, meta, q, k, v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interpreted = device.type != "cuda"
    if interpreted:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tandem.engine.attention import TorchAttentionBackend
    from tandem.engine.attention.triton_backend import TritonAttentionBackend

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    batch, context, prefill = (64, 4096, 8192) if not args.small else (2, 256, 128)
    rounds = args.rounds if not args.small else 1
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
               "interpreted": interpreted, "dtype": str(dtype).removeprefix("torch.")}

    bw = bandwidth(device, rounds)
    kv, meta, q, k, v = paged_batch([context - 1] * batch, [1] * batch, heads, kv_heads, head_dim, block_size,
                                    dtype, device)
    scale = head_dim**-0.5
    kv_bytes = batch * context * kv_heads * head_dim * 2 * kv.element_size()
    t_triton = timed(lambda: triton_backend.forward(q, k, v, kv, meta, scale), rounds, device)
    t_torch = timed(lambda: torch_backend.forward(q, k, v, kv, meta, scale), rounds, device)
    results["decode"] = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "bandwidth_gb_s": bw / 1e9,
                         "triton_s": t_triton, "torch_s": t_torch, "speedup_vs_torch": t_torch / t_triton,
                         "fraction_of_bandwidth": kv_bytes / t_triton / bw,
                         "by_splits": split_sweep(q, kv, meta, scale, kv_bytes, bw, rounds, device)}

    rate = matmul_rate(device, dtype, rounds)
    kv, meta, q, k, v = paged_batch([0], [prefill], heads, kv_heads, head_dim, block_size, dtype, device)
    flops = 4 * heads * head_dim * prefill * prefill / 2  # QK^T and PV over the causal half
    t_triton = timed(lambda: triton_backend.forward(q, k, v, kv, meta, scale), rounds, device)
    t_torch = timed(lambda: torch_backend.forward(q, k, v, kv, meta, scale), rounds, device)
    results["prefill"] = {"tokens": prefill, "flops": flops, "matmul_tflops": rate / 1e12, "triton_s": t_triton,
                          "torch_s": t_torch, "speedup_vs_torch": t_torch / t_triton,
                          "fraction_of_matmul_rate": flops / t_triton / rate}
    if not interpreted:  # the tile shapes triton.autotune chose on this GPU for the two shapes above
        from tandem.engine.attention import triton_decode, triton_prefill

        for name, kernel in (("decode", triton_decode._split_kernel), ("prefill", triton_prefill._prefill_kernel)):
            results[name]["config"] = str(kernel.best_config)
            timings = getattr(kernel, "configs_timings", None) or {}  # every candidate's time (ms), where kept
            results[name]["candidates_ms"] = {str(c): t[0] if isinstance(t, list) else t for c, t in timings.items()}
    fractions = {"decode": results["decode"]["fraction_of_bandwidth"],
                 "prefill": results["prefill"]["fraction_of_matmul_rate"]}
    results["decode_fraction_of_bandwidth"] = fractions["decode"]
    results["prefill_fraction_of_matmul"] = fractions["prefill"]
    results["targets"] = TARGETS
    results["targets_met"] = {name: None if interpreted else fractions[name] >= TARGETS[name] for name in TARGETS}
    for name in ("decode", "prefill"):
        print(f"{name}: {results[name]}", flush=True)
    for name, target in TARGETS.items():
        verdict = "n/a, interpreted" if interpreted else ("met" if results["targets_met"][name] else "missed")
        print(f"{name}: {fractions[name]:.3f} of its floor, target {target:.2f}: {verdict}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
