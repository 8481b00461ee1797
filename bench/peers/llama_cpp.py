"""llama.cpp on the same GGUF file as tandem's embedded model, through llama-cpp-python (`make bench-peers` builds
it for this CPU): batch-1 decode, and batched decode of many sequences at once, greedy, with the same threads.

    .venv/bin/python bench/peers/llama_cpp.py [--threads 2] [--tokens 64] [--sequences 64]

Batch-1 decode rate is measured as bench/decode_roofline.py measures tandem: (tokens - 1) / (time of a
`tokens`-token generation - time of a 1-token one), so prefill and set-up cancel out. Batched decode: `sequences`
prompts prefilled into one context (one sequence id each), then every step decodes one token of every sequence
in one `llama_decode` call; output tokens/s over the whole run (prefill included), as bench/engine_throughput.py
counts tandem's. The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def load(model_path: str, threads: int, n_ctx: int, n_seq_max: int = 1):
    """A llama_cpp.Llama on model_path (raises ImportError with how to install it when it is missing)."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError("llama-cpp-python is not installed: run `make bench-peers` (it builds llama.cpp for "
                          "this CPU)") from e
    return llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=2048, n_ubatch=2048, n_seq_max=n_seq_max, verbose=False)


def greedy(llm, ids: list[int], tokens: int) -> list[int]:
    """`tokens` greedy tokens after ids (end-of-sequence ignored), on a fresh context."""
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == tokens:
            break
    return out


def batch1_rate(llm, prompts: list[list[int]], tokens: int) -> float:
    greedy(llm, max(prompts, key=len), tokens)  # warm-up
    full = one = 0.0
    for ids in prompts:
        start = time.perf_counter()
        greedy(llm, ids, 1)
        one += time.perf_counter() - start
        start = time.perf_counter()
        greedy(llm, ids, tokens)
        full += time.perf_counter() - start
    return len(prompts) * (tokens - 1) / (full - one)


def batched_rate(llm, prompts: list[list[int]], tokens: int) -> dict:
    """Every prompt its own sequence in one context; one llama_decode per step for all of them."""
    import llama_cpp

    ctx, n_vocab = llm.ctx, llm.n_vocab()
    capacity = max(sum(len(p) for p in prompts), len(prompts))
    batch = llama_cpp.llama_batch_init(capacity, 0, len(prompts))

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits

    def argmax(row: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))

    try:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        start = time.perf_counter()
        entries, rows = [], []
        for seq, ids in enumerate(prompts):
            for pos, token in enumerate(ids):
                entries.append((token, pos, seq, pos == len(ids) - 1))
            rows.append(len(entries) - 1)
        fill(entries)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed on the prompts")
        last = [argmax(r) for r in rows]
        positions = [len(p) for p in prompts]
        generated = len(prompts)
        for _ in range(tokens - 1):
            fill([(last[s], positions[s], s, True) for s in range(len(prompts))])
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed in a decode step")
            last = [argmax(s) for s in range(len(prompts))]
            positions = [p + 1 for p in positions]
            generated += len(prompts)
        elapsed = time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
    return {"tokens_per_s": generated / elapsed, "seconds": elapsed, "sequences": len(prompts)}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.machine import machine_line
    from tandem.engine.loader import default_model_path, load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args()
    tokenizer = load_model(None, weights=False, progress=False).tokenizer
    from bench.engine_throughput import prompts

    requests = prompts(tokenizer, args.sequences)
    path = str(default_model_path())
    llm = load(path, args.threads, n_ctx=2048)
    rate = batch1_rate(llm, requests[:3], args.tokens)
    del llm
    llm = load(path, args.threads, n_ctx=args.sequences * (max(map(len, requests)) + args.tokens),
               n_seq_max=args.sequences)
    batched = batched_rate(llm, requests, args.tokens)
    print(f"llama.cpp: batch-1 decode {rate:.1f} tok/s; {args.sequences} sequences "
          f"{batched['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    print(json.dumps({"machine": machine_line(), "model": path, "threads": args.threads, "tokens": args.tokens,
                      "batch1_tokens_per_s": rate, "batched": batched}))


if __name__ == "__main__":
    main()
