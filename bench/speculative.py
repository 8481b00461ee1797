"""Speculative decoding's proposers against the embedded model's own greedy output, replayed offline (issue 25).

The proposers are not in the engine's step yet, so this measures what they would get: each workload's prompts are
decoded greedily without speculation; then, step by step along each output, each proposer proposes --k tokens from
the tokens so far, and the tokens the target itself produced next decide how many would be accepted (greedy
verification accepts exactly the longest common prefix). Reported per proposer and workload: the acceptance rate
(accepted / proposed), the mean tokens per verification step (accepted + 1: the upper bound on the speed-up when a
step of k+1 tokens costs what a step of 1 does) and the share of steps with nothing proposed. Workloads, as issue 25
names them: repetition-heavy (code editing, summarizing with quotes, JSON extraction from a given document),
multi-turn chat that repeats earlier answers, and open chat. The suffix proposer sees the requests of a workload in
order and keeps their outputs (one tenant).

    .venv/bin/python bench/speculative.py [--k 4] [--tokens 96] [--threads 2]

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine_line  # noqa: E402

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
'''
DOCUMENT = ("Order 1182 was placed by Maria Lopez on 3 March 2024. She ordered two blue kettles at 24.50 euros "
            "each and one toaster at 39.90 euros. Delivery goes to Calle Mayor 12, Madrid. She paid by card.")
ARTICLE = ("The city council approved the new bike lane plan on Tuesday. \"We want safer streets for everyone,\" "
           "said the mayor. The plan adds 40 km of protected lanes by 2026. Critics said the plan removes parking. "
           "\"Shops will lose customers,\" said a local shop owner.")

WORKLOADS = {
    "repetition": [
        [{"role": "user", "content": f"Rename the variable subtotal to net in this code and return the whole code:\n{CODE}"}],
        [{"role": "user", "content": f"Summarize this article, quoting the mayor and the shop owner exactly:\n{ARTICLE}"}],
        [{"role": "user", "content": f"Extract the customer name, date, items and address from this order as JSON:\n{DOCUMENT}"}],
        [{"role": "user", "content": f"Add a docstring to this function and return the whole code:\n{CODE}"}],
    ],
    "multi_turn": [
        [{"role": "user", "content": "What is a good name for a bakery?"},
         {"role": "assistant", "content": "A good name for a bakery is Golden Crust Bakery, because it sounds warm."},
         {"role": "user", "content": "Repeat your suggestion and explain it again in one sentence."}],
        [{"role": "user", "content": "Give me three tips to sleep better."},
         {"role": "assistant", "content": "1. Keep a regular schedule. 2. Avoid screens before bed. 3. Keep the room "
                                          "cool and dark."},
         {"role": "user", "content": "Please list the same three tips again, with one more sentence for each."}],
    ],
    "open_chat": [
        [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
        [{"role": "user", "content": "Why is the sky blue? Explain simply."}],
        [{"role": "user", "content": "What should I pack for a weekend hiking trip?"}],
    ],
}


def greedy_outputs(loaded, chats, tokens: int) -> list[tuple[list[int], list[int]]]:
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    prompts = [loaded.tokenizer.encode_chat(c) for c in chats]
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    with LLMEngine(loaded, EngineConfig(num_kv_blocks=1024, max_num_seqs=16, compile=False)) as engine:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=tokens, temperature=0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id].extend(out.token_ids)
    return [(p, outs[f"r{i}"]) for i, p in enumerate(prompts)]


def replay(proposer, runs: list[tuple[list[int], list[int]]], k: int, shared: bool) -> dict:
    proposed = accepted = steps = empty = 0
    per_step = []
    for i, (prompt, output) in enumerate(runs):
        seq_id = f"s{i}"
        if shared:
            proposer.start(seq_id, salt="tenant")
        pos = 0
        while pos < len(output):
            guess = proposer.propose(seq_id, prompt + output[:pos], k)
            n = 0
            while n < len(guess) and pos + n < len(output) and guess[n] == output[pos + n]:
                n += 1
            proposed += len(guess)
            accepted += n
            empty += not guess
            steps += 1
            per_step.append(n + 1)
            pos += n + 1  # the accepted tokens and the target's own next one
        if shared:
            proposer.forget(seq_id, output)
        else:
            proposer.forget(seq_id)
    return {"acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "tokens_per_step": round(statistics.mean(per_step), 3), "steps": steps,
            "steps_without_proposal": round(empty / steps, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per step")
    parser.add_argument("--tokens", type=int, default=96, help="greedy output tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tandem.engine.loader import load_model
    from tandem.engine.proposers import NgramProposer
    from tandem.engine.suffix_proposer import SuffixProposer

    loaded = load_model(progress=False)
    results: dict[str, dict] = {}
    for workload, chats in WORKLOADS.items():
        runs = greedy_outputs(loaded, chats, args.tokens)
        results[workload] = {"ngram": replay(NgramProposer(min_n=2, max_n=4), runs, args.k, shared=False),
                             "suffix": replay(SuffixProposer(), runs, args.k, shared=True)}
        for name, r in results[workload].items():
            print(f"{workload:11s} {name:6s}: acceptance {r['acceptance_rate']}, {r['tokens_per_step']} tokens per "
                  f"step, {r['steps_without_proposal']:.0%} of steps without a proposal", file=sys.stderr)
    print(json.dumps({"bench": "speculative", "mode": "offline replay of greedy output (not in the engine yet)",
                      "machine": machine_line(), "k": args.k, "tokens": args.tokens, "workloads": results}))


if __name__ == "__main__":
    main()
