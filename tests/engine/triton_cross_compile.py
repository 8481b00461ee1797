"""Compiles every Triton kernel tandem launches for an NVIDIA GPU, on a machine with no GPU: the kernels' Python
wrappers run on CPU tensors for each dtype an engine on a GPU uses (bfloat16, float16, float32, int8 and fp8
pages), each launch is caught instead of run, and Triton's own compiler builds it for the target (sm_90 by
default: H100/H200) down to a cubin with the ptxas it ships. The interpreter the CPU tests run the kernels on
executes them as plain Python and misses what only the compiler sees (dtype rules of tl.dot, constexpr branches,
shapes a configuration cannot tile): on a GPU, every bfloat16 engine once failed to compile its attention while
every CPU test passed.

Needs a process where TRITON_INTERPRET is unset (the kernel modules read it when imported; tests/conftest.py sets
it for the test process), so the test runs this file as a script:

    python tests/engine/triton_cross_compile.py [--arch 90] [--all-configs]

--all-configs compiles every autotune configuration of every launch (default: the first of each). The last line of output is one JSON object: {"arch", "compiled":
[{kernel, case, config}], "failed": [{kernel, case, config, error}]}. Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BLOCK = 16
HEAD_DIM = 64
KV_HEADS = 2
GROUP = 3


def _launches():
    """Runs each kernel's wrapper on CPU tensors for every case; returns [(case, kernel, args, kwargs)] of the
    launches they made (none of them runs)."""
    import tandem.engine.attention.triton_decode as decode
    import tandem.engine.attention.triton_norm as norm
    import tandem.engine.attention.triton_prefill as prefill
    from tandem.engine.attention import AttentionMetadata
    from tandem.engine.attention.kv_quant import convert_blocks
    from tandem.engine.attention.triton_backend import TritonAttentionBackend

    launches: list = []
    case = {"name": ""}

    class Catch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((case["name"], self.kernel, args, kwargs))

    for module, name in ((decode, "_split_kernel"), (decode, "_combine_kernel"), (prefill, "_prefill_kernel"),
                         (norm, "_rms_norm_kernel"), (norm, "_rotary_kernel")):
        setattr(module, name, Catch(getattr(module, name)))

    def batch(query_lens, computed, dtype, cache_dtype):
        totals = [q + c for q, c in zip(query_lens, computed)]
        tables, first = [], 0
        for t in totals:
            n = -(-t // BLOCK)
            tables.append(list(range(first, first + n)))
            first += n
        meta = AttentionMetadata.build(query_lens, computed, tables, BLOCK, torch.device("cpu"))
        kv = torch.randn(2, first + 1, KV_HEADS, BLOCK, HEAD_DIM)
        kv = convert_blocks(kv, BLOCK, cache_dtype) if cache_dtype in (torch.int8, torch.float8_e4m3fn) \
            else kv.to(cache_dtype)
        t = sum(query_lens)
        q, k, v = (torch.randn(t, h, HEAD_DIM).to(dtype) for h in (KV_HEADS * GROUP, KV_HEADS, KV_HEADS))
        return q, k, v, kv, meta

    backend = TritonAttentionBackend()
    for dtype, cache in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                         (torch.float32, torch.float32), (torch.bfloat16, torch.int8),
                         (torch.bfloat16, torch.float8_e4m3fn)):
        label = str(dtype).removeprefix("torch.") + "/" + str(cache).removeprefix("torch.")
        for mode, lens, done in (("decode", [1, 1], [40, 7]), ("prefill", [20, 1], [5, 30])):
            for window in (None, 8):
                case["name"] = f"{mode} {label}" + (" window" if window else "")
                q, k, v, kv, meta = batch(lens, done, dtype, cache)
                backend.forward(q, k, v, kv, meta, HEAD_DIM ** -0.5, window)
    for dtype in (torch.bfloat16, torch.float32):
        case["name"] = f"norm {str(dtype).removeprefix('torch.')}"
        x = torch.randn(3, 96).to(dtype)
        norm.rms_norm(x, torch.ones(96, dtype=dtype), 1e-5, x.clone())
        rows = torch.randn(3, 4, HEAD_DIM).to(dtype)
        tables = torch.randn(16, HEAD_DIM // 2)
        norm.rotary_(rows, torch.arange(3), tables, tables)
    return launches


def _signature(jit, args, constants) -> dict[str, str]:
    """Triton's type string of each argument (the constexprs by name)."""
    from triton.runtime.jit import mangle_type

    signature = {}
    for name, value in zip((n for n in jit.arg_names if n not in constants), args):
        signature[name] = mangle_type(value)
    return signature | {name: "constexpr" for name in constants}


def _configs(kernel, every: bool):
    """(JITFunction, [(constexprs, options)]) for a launch of `kernel`: an autotuned kernel's configurations (the
    first only unless every), or the one launch of a plain kernel."""
    from triton.runtime.autotuner import Autotuner

    if isinstance(kernel, Autotuner):
        chosen = kernel.configs if every else kernel.configs[:1]
        return kernel.fn, [(dict(c.kwargs), {"num_warps": c.num_warps, "num_stages": c.num_stages})
                           for c in chosen]
    return kernel, [({}, {"num_warps": 4, "num_stages": 2})]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (80: A100, 90: H100/H200)")
    parser.add_argument("--all-configs", action="store_true")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("triton_cross_compile.py: TRITON_INTERPRET=1 is set; the compiler needs it unset")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    compiled, failed, seen = [], [], set()
    for case, kernel, call_args, kwargs in _launches():
        every = args.all_configs
        jit, configs = _configs(kernel, every)
        for tuned, options in configs:
            constants = kwargs | tuned
            signature = _signature(jit, call_args, constants)
            key = (jit.__name__, json.dumps(signature, sort_keys=True), json.dumps(constants, sort_keys=True,
                                                                                   default=str), str(options))
            if key in seen:
                continue
            seen.add(key)
            row = {"kernel": jit.__name__, "case": case, "config": tuned | options}
            try:
                triton.compile(ASTSource(jit, signature, constants), target=target, options=options)
                compiled.append(row)
            except Exception as e:  # noqa: BLE001 - each failure is a result, reported with its message
                failed.append(row | {"error": f"{type(e).__name__}: {str(e)[-800:]}"})
                print(f"FAILED {row}: {failed[-1]['error']}", file=sys.stderr)
    print(json.dumps({"arch": args.arch, "triton": triton.__version__, "compiled": compiled, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
