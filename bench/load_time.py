"""Load time of the embedded model (weights and tokenizer), tandem vs transformers on the same GGUF file.

    .venv/bin/python bench/load_time.py [--repeats 3]

Each figure is the best of --repeats loads in this process (the file is in the page cache after the first).
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def best_of(repeats: int, load) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        load()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.loader import default_model_path, load_model

    path = default_model_path()
    results = {
        "model": path.name,
        "tandem_float32_s": best_of(args.repeats, lambda: load_model(progress=False)),
        "tandem_packed_int4_s": best_of(args.repeats, lambda: load_model(progress=False, weight_format="packed",
                                                                         dtype=torch.bfloat16)),
        "transformers_float32_s": best_of(args.repeats, lambda: (
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
            AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32))),
    }
    results["speedup_vs_transformers"] = results["transformers_float32_s"] / results["tandem_float32_s"]
    for key, value in results.items():
        if key.endswith("_s"):
            print(f"{key}: {value:.2f} s", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
