"""The measured kernel choice against the fixed one and against plain `F.linear`, per projection shape and rows.

For each weight shape of the embedded model (fused QKV, O, gate/up, down, LM head) and dtype, three ways to run
the product, each over enough copies of the weight to read it from memory (as a decode step over 30 layers does):
- tuned: the plan this CPU's measurement chose (engine/models/linear.py `tuned_plan`, what the engine runs);
- fixed: the plan without measurement (`fixed_plan`, the choices measured on the CI machines, what ran before);
- F.linear: torch with no kernel choice (the peer).
The tuner's cache (engine/hardware/kernel_tuning.py) is used as the engine uses it: a first run measures and stores.

    .venv/bin/python bench/linear_kernels.py [--threads 2] [--rows 1,4,16,64,256] [--dtypes float32,bfloat16]

To measure an AVX2 CPU's paths on an AVX-512 machine: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import cpu_report, machine_line  # noqa: E402
from tandem.engine.hardware.cpu_features import cpu_features  # noqa: E402
from tandem.engine.hardware.kernel_tuning import KernelTuner, copies_for, time_per_call  # noqa: E402
from tandem.engine.models.linear import Linear, fixed_plan, tuned_plan  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tuner = KernelTuner(cpu_features())
    results = {"machine": machine_line(), "cpu": cpu_report(), "threads": args.threads, "tuner": tuner.describe(),
               "runs": []}
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        name = str(dtype).removeprefix("torch.")
        for shape_name, (out_features, in_features) in SHAPES.items():
            tuned, fixed = tuned_plan(tuner, dtype, out_features, in_features), fixed_plan(dtype, CPU)
            weights = [(torch.rand(out_features, in_features) - 0.5).to(dtype)
                       for _ in range(copies_for(out_features * in_features * dtype.itemsize))]
            layers = {plan: [Linear(w, None, dtype=dtype, device=CPU, plan=plan) for w in weights]
                      for plan in (tuned, fixed)}
            print(f"{name} {shape_name} {out_features}x{in_features}: tuned {tuned.describe()}; fixed "
                  f"{fixed.describe()}", file=sys.stderr)
            for rows in map(int, args.rows.split(",")):
                x = (torch.rand(rows, in_features) - 0.5).to(dtype)
                with torch.inference_mode():
                    us = {"tuned": time_per_call([lambda layer=layer: layer(x) for layer in layers[tuned]]),
                          "fixed": time_per_call([lambda layer=layer: layer(x) for layer in layers[fixed]]),
                          "f_linear": time_per_call([lambda w=w: F.linear(x, w) for w in weights])}
                us = {k: v * 1e6 for k, v in us.items()}
                row = {"dtype": name, "shape": shape_name, "out": out_features, "in": in_features, "rows": rows,
                       "tuned_kernel": tuned.by_rows.kernel_for(rows), "fixed_kernel": fixed.by_rows.kernel_for(rows),
                       **{f"{k}_us": v for k, v in us.items()},
                       "tuned_vs_fixed": us["fixed"] / us["tuned"], "tuned_vs_f_linear": us["f_linear"] / us["tuned"]}
                results["runs"].append(row)
                print(f"  rows {rows:4d}: tuned {row['tuned_kernel']:13s} {us['tuned']:9.0f} us, fixed "
                      f"{row['fixed_kernel']:9s} {us['fixed']:9.0f} us ({row['tuned_vs_fixed']:.2f}x), F.linear "
                      f"{us['f_linear']:9.0f} us ({row['tuned_vs_f_linear']:.2f}x)", file=sys.stderr)
    for key in ("tuned_vs_fixed", "tuned_vs_f_linear"):
        results[f"geomean_{key}"] = statistics.geometric_mean(r[key] for r in results["runs"])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
