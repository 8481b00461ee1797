"""llama.cpp on the same GGUF file as tandem's embedded model, through llama-cpp-python (`make bench-peers` builds
it for this CPU): batch-1 decode, and batched decode of many sequences at once, greedy, with the same threads.

    .venv/bin/python bench/peers/llama_cpp_peer.py [--threads 2] [--tokens 64] [--sequences 64]
    .venv/bin/python bench/peers/llama_cpp_peer.py --prompts FILE.json --mode batch1|batched   # one measurement

The benchmarks that compare with it (decode_roofline.py, engine_throughput.py --llama-cpp) run it in a process of
its own for each round (`measure`, the second form above): in the benchmark's process its threads, which wait for
work spinning, take the cores from torch's between its calls (measured: tandem's 8-request rate fell from 250-300
to 76-88 tok/s beside it), and torch's from it.

Batch-1 decode rate is measured as bench/decode_roofline.py measures tandem: (tokens - 1) / (time of a
`tokens`-token generation - time of a 1-token one), so prefill and set-up cancel out. Batched decode: `sequences`
prompts prefilled into one context (one sequence id each), then every step decodes one token of every sequence
in one `llama_decode` call; output tokens/s over the whole run (prefill included), as bench/engine_throughput.py
counts tandem's. The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


BATCH = 512  # tokens per llama_decode call of the batched run (llama.cpp's default batch)


def load(model_path: str, threads: int, n_ctx: int):
    """A llama_cpp.Llama on model_path (raises ImportError with how to install it when it is missing)."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError("llama-cpp-python is not installed: run `make bench-peers` (it builds llama.cpp for "
                          "this CPU)") from e
    return llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=BATCH, n_ubatch=BATCH, verbose=bool(os.environ.get("LLAMA_VERBOSE")))


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


def batched_rate(llm, prompts: list[list[int]], tokens: int, threads: int) -> dict:
    """Every prompt its own sequence in one context of llm's model (a unified KV cache, one sequence id each):
    the prompts in batches of up to BATCH tokens, then one llama_decode per step for all of them."""
    import llama_cpp

    n_vocab = llm.n_vocab()
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = len(prompts) * (max(map(len, prompts)) + tokens)
    params.n_batch = params.n_ubatch = BATCH
    params.n_seq_max, params.kv_unified = len(prompts), True
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context for the batched run")
    batch = llama_cpp.llama_batch_init(BATCH, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Decodes (token, position, sequence, wants logits) entries, BATCH at a time; returns the greedy next
        token of each sequence that wanted logits."""
        chosen = {}
        for first in range(0, len(entries), BATCH):
            chunk = entries[first:first + BATCH]
            batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    row = llama_cpp.llama_get_logits_ith(ctx, i)
                    chosen[seq] = int(np.argmax(np.ctypeslib.as_array(row, shape=(n_vocab,))))
        return chosen

    try:
        start = time.perf_counter()
        last = decode([(token, pos, seq, pos == len(ids) - 1)
                       for seq, ids in enumerate(prompts) for pos, token in enumerate(ids)])
        positions = [len(p) for p in prompts]
        outputs = [[last[s]] for s in range(len(prompts))]
        for _ in range(tokens - 1):
            last = decode([(last[s], positions[s], s, True) for s in range(len(prompts))])
            positions = [p + 1 for p in positions]
            for s, out in enumerate(outputs):
                out.append(last[s])
        elapsed = time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return {"tokens_per_s": tokens * len(prompts) / elapsed, "seconds": elapsed, "sequences": len(prompts),
            "token_ids": outputs}


def measure(mode: str, prompts: list[list[int]], tokens: int, threads: int) -> dict:
    """One measurement of llama.cpp on the embedded GGUF file in a process of its own (see the module docstring):
    mode "batch1" ({"tokens_per_s"}: batch1_rate over prompts) or "batched" (batched_rate's numbers). Raises
    RuntimeError with its output when it fails."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(prompts, f)
        f.flush()
        done = subprocess.run([sys.executable, __file__, "--prompts", f.name, "--mode", mode, "--tokens", str(tokens),
                               "--threads", str(threads)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's {mode} measurement failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.machine import machine_line
    from tandem.engine.loader import default_model_path, load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompts", default=None, help="a JSON list of token id lists: one measurement of them")
    parser.add_argument("--mode", choices=["batch1", "batched"], default="batch1", help="with --prompts")
    args = parser.parse_args()
    if args.prompts is not None:
        requests = json.loads(Path(args.prompts).read_text())
        llm = load(str(default_model_path()), args.threads, n_ctx=2048)
        if args.mode == "batch1":
            print(json.dumps({"tokens_per_s": batch1_rate(llm, requests, args.tokens)}))
        else:
            result = batched_rate(llm, requests, args.tokens, args.threads)
            result.pop("token_ids")
            print(json.dumps(result))
        return
    tokenizer = load_model(None, weights=False, progress=False).tokenizer
    from bench.engine_throughput import prompts

    requests = prompts(tokenizer, args.sequences)
    path = str(default_model_path())
    llm = load(path, args.threads, n_ctx=2048)
    rate = batch1_rate(llm, requests[:3], args.tokens)
    batched = batched_rate(llm, requests, args.tokens, args.threads)
    print(f"llama.cpp: batch-1 decode {rate:.1f} tok/s; {args.sequences} sequences "
          f"{batched['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    batched.pop("token_ids")
    print(json.dumps({"machine": machine_line(), "model": path, "threads": args.threads, "tokens": args.tokens,
                      "batch1_tokens_per_s": rate, "batched": batched}))


if __name__ == "__main__":
    main()
