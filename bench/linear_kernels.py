"""Every projection kernel this CPU runs, timed on the embedded model's shapes against plain `F.linear`.

For each weight shape (the embedded model's fused QKV, gate/up, down and LM head) and row count (1 = batch-1
decode, up to a prefill chunk), each kernel of `engine/models/linear.py` that the CPU probe says runs here
(forced through CpuFeatures, so an AVX-512 machine times the AVX2 paths too) is timed per call, best of
--repeats batches, and compared with `F.linear` on the same weights and dtype in the same run (the peer: what
torch does with no kernel choice). Kernels the CPU cannot run are listed under `not_run` with the reason.

    .venv/bin/python bench/linear_kernels.py [--threads 2] [--rows 1,4,8,16,64,512] [--repeats 5]

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import cpu_report, machine_line  # noqa: E402
from tandem.engine.cpu_features import cpu_features  # noqa: E402
from tandem.engine.models.linear import Linear, choose_kernel  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
CPU = torch.device("cpu")
# kernel -> (dtype, the feature that must run here, the features that make choose_kernel pick it)
CANDIDATES = {
    "split": (torch.float32, "onednn", {}),
    "onednn": (torch.bfloat16, "onednn_bf16", {}),
    "widen": (torch.bfloat16, None, {"onednn_bf16": False}),
}


def per_call_us(fn, budget_s: float, repeats: int) -> float:
    """Best over `repeats` batches of the mean time per call, each batch about budget_s / repeats long."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / repeats / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16,64,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=0.5, help="time per measurement (all repeats)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    here = cpu_features()
    results = {"machine": machine_line(), "cpu": cpu_report(), "threads": args.threads, "not_run": {},
               "runs": []}
    for kernel, (dtype, needs, forced) in CANDIDATES.items():
        if needs and not getattr(here, needs):
            results["not_run"][kernel] = here.why_not[needs]
            print(f"{kernel}: not on this CPU ({here.why_not[needs]})", file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    for shape_name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features, generator=g)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=g)
            for kernel, (dtype, needs, forced) in CANDIDATES.items():
                if kernel in results["not_run"]:
                    continue
                features = dataclasses.replace(here, **forced)
                assert choose_kernel(dtype, CPU, features) == kernel
                layer = Linear(weight, None, dtype=dtype, device=CPU, cpu=features)
                peer_weight, xd = weight.to(dtype), x.to(dtype)
                with torch.inference_mode():
                    ours = per_call_us(lambda: layer(xd), args.budget_s, args.repeats)
                    peer = per_call_us(lambda: F.linear(xd, peer_weight), args.budget_s, args.repeats)
                row = {"shape": shape_name, "out": out_features, "in": in_features, "rows": rows, "kernel": kernel,
                       "dtype": str(dtype).removeprefix("torch."), "kernel_us": ours, "f_linear_us": peer,
                       "speedup_vs_f_linear": peer / ours}
                results["runs"].append(row)
                print(f"{shape_name} {out_features}x{in_features} rows {rows:4d} {kernel:7s} {row['dtype']:8s} "
                      f"{ours:10.0f} us  F.linear {peer:10.0f} us  {peer / ours:5.2f}x", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
