"""Speculative decoding in the engine against decoding without it, on issue 25's three workloads (this machine).

For each workload (repetition-heavy: code editing, summarizing with quotes, JSON extraction from a given document;
multi-turn chat that repeats earlier answers; open chat) and each proposer (n-gram prompt lookup, suffix tries) this
runs the engine with speculation (adaptive: the cost model picks how many proposals to verify, down to none) and
without, and reports output tokens per second and the ratio:
  - batch 1: the workload's prompts one after the other, greedy (the suffix proposer sees the earlier ones' outputs,
    as a replica serving one user would);
  - batch 16: --requests (48) requests cycling over the prompts, 16 in flight at a time (a finished one's slot goes
    to the next at once, as a serving replica's would), sampled (temperature 0.8, seed per request), so that each
    stream is different. Several waves of requests make the run long enough (about 1500 tokens) that run-to-run
    noise is a few percent, not the 15% of one 16-request wave.
Each (round, setting) gets a fresh engine (the proposer's cache and the cost model start empty: no round learns from
the last one's identical outputs), the settings in rotating order within a round; the reported figure is the median
over rounds. Outputs are checked to be identical to those without speculation (in float32 they must be, sampled or
greedy; in bfloat16 the share that is, same_outputs, is reported).
Acceptance: accepted / proposed tokens, and tokens per verified step, from the engine's own counters.

    .venv/bin/python bench/speculative.py [--rounds 3] [--tokens 96] [--k 4] [--threads 2]
        [--requests 48] [--batches 1,16] [--workloads repetition,multi_turn,open_chat]
        [--proposers ngram,suffix,draft] [--replay] [--device cuda]

The draft proposer's default draft ('self': the model's own GGUF weights packed 4-bit) runs on the CPU only, so
--device cuda leaves it out of the default proposers.

--replay adds the offline replay of the proposers against the model's own greedy output (acceptance only, no
timing). The last line of output is one JSON object with every number.
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
from bench.machine import embedded_on, machine_line  # noqa: E402

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


def engine_run(loaded, requests: list[list[int]], tokens: int, batch: int, speculative, k: int) -> dict:
    """Runs requests through a fresh engine, at most `batch` at a time (batch 1: one after the other, greedy; more:
    all queued at once, sampled); returns tokens/s, outputs and speculation counters."""
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.sampling_params import SamplingParams

    config = EngineConfig(num_kv_blocks=1024, max_num_seqs=batch, enable_prefix_caching=False,
                          speculative=speculative)
    outs: dict[str, list[int]] = {}
    with LLMEngine(loaded, config) as engine:
        start = time.perf_counter()
        for i, prompt in enumerate(requests):
            params = SamplingParams(max_tokens=tokens, temperature=0 if batch == 1 else 0.8, seed=i)
            engine.add_request(f"r{i}", prompt, params)
            outs[f"r{i}"] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id].extend(out.token_ids)
        seconds = time.perf_counter() - start
        stats = engine.speculation_stats()
        steps = engine.num_steps
        speculator = engine.scheduler.speculator
        lines = (speculator.cost.line(), speculator.verify.line()) if speculator is not None else None
        timed = speculator.timed_steps() if speculator is not None else None
    produced = sum(len(o) for o in outs.values())
    result = {"tokens_per_s": produced / seconds, "outputs": outs, "steps": steps}
    if stats is not None:
        verified = sum(stats.acceptance_counts)
        result.update(acceptance_rate=round(stats.acceptance_rate, 3), proposed=stats.proposed,
                      accepted=stats.accepted, verified_steps=verified, declined_steps=stats.declined_steps,
                      tokens_per_verified_step=round((stats.accepted + verified) / verified, 3) if verified else None,
                      step_ms=round(1e3 * lines[0][0], 2), seq_ms=round(1e3 * lines[0][1], 3),
                      verify_ms=round(1e3 * lines[1][0], 2), proposal_ms=round(1e3 * lines[1][1], 3),
                      timed_steps=timed)
    return result


def measure(loaded, workloads: dict, args) -> dict:
    from tandem.engine.engine_config import SpeculativeConfig

    settings = {"off": None} | {name: SpeculativeConfig(proposer=name, max_tokens=args.k)
                                 for name in args.proposers.split(",")}
    results: dict = {}
    for workload, chats in workloads.items():
        prompts = [loaded.tokenizer.encode_chat(c) for c in chats]
        for batch in args.batches:
            requests = prompts if batch == 1 else [prompts[i % len(prompts)] for i in range(args.requests)]
            runs: dict[str, list[dict]] = {name: [] for name in settings}
            for r in range(args.rounds):
                names = list(settings)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    runs[name].append(engine_run(loaded, requests, args.tokens, batch, settings[name], args.k))
            off = statistics.median(run["tokens_per_s"] for run in runs["off"])
            row = {"off": {"tokens_per_s": round(off, 1),
                           "rounds": [round(run["tokens_per_s"], 1) for run in runs["off"]]}}
            reference = runs["off"][0]["outputs"]
            for name in list(settings)[1:]:
                same = min(same_outputs(run["outputs"], reference) for run in runs[name])
                if same < 1 and loaded.model.dtype == torch.float32:
                    raise SystemExit(f"{workload} batch {batch}: {name} changed the output")
                rate = statistics.median(run["tokens_per_s"] for run in runs[name])
                last = runs[name][-1]
                row[name] = {"tokens_per_s": round(rate, 1), "speedup": round(rate / off, 3), "same_outputs": same,
                             "rounds": [round(run["tokens_per_s"], 1) for run in runs[name]],
                             **{k: last[k] for k in ("acceptance_rate", "tokens_per_verified_step", "verified_steps",
                                                     "declined_steps", "steps", "step_ms", "seq_ms", "verify_ms",
                                                     "proposal_ms", "timed_steps")}}
                print(f"{workload:11s} batch {batch:2d} {name:6s}: {rate:7.1f} tok/s vs {off:7.1f} off = "
                      f"{rate / off:.2f}x; acceptance {last['acceptance_rate']}, "
                      f"{last['tokens_per_verified_step']} tokens per verified step; cost model: "
                      f"{last['step_ms']} ms + {last['seq_ms']} ms/sequence, verifying {last['verify_ms']} ms + "
                      f"{last['proposal_ms']} ms/proposal; decode steps timed (plain, verifying) by batch size: "
                      f"{last['timed_steps']}; outputs as without speculation: {same:.0%}", file=sys.stderr)
            results.setdefault(workload, {})[f"batch_{batch}"] = row
    return results


def same_outputs(outputs: dict, reference: dict) -> float:
    """The share of requests whose output is the reference's token for token. In float32 speculation must keep every
    output (the main loop stops otherwise); in bfloat16 verifying several tokens in one pass sums in another order
    than decoding them one by one, and a near-tie can round the other way (seen on an H200), so it is reported."""
    return round(sum(outputs[key] == reference[key] for key in reference) / len(reference), 3)


def greedy_outputs(loaded, chats, tokens: int) -> list[tuple[list[int], list[int]]]:
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
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
    parser.add_argument("--k", type=int, default=4, help="most tokens proposed per sequence and step")
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request at most")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48, help="requests of each case above batch 1, that many in flight")
    parser.add_argument("--batches", default="1,16", type=lambda text: [int(b) for b in text.split(",")],
                        help="the batch sizes to run (1: one request after another; more: --requests queued)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--proposers", default=None,
                        help="comma-separated subset (default ngram,suffix,draft; ngram,suffix on cuda)")
    parser.add_argument("--replay", action="store_true", help="also replay the proposers offline")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the engine runs (float32 on the CPU, bfloat16 on CUDA)")
    args = parser.parse_args()
    if args.proposers is None:
        args.proposers = "ngram,suffix,draft" if args.device == "cpu" else "ngram,suffix"
    torch.set_num_threads(args.threads)

    from tandem.engine.decoding.proposers import NgramProposer
    from tandem.engine.decoding.suffix_proposer import SuffixProposer

    loaded, dtype = embedded_on(args.device)
    workloads = {name: WORKLOADS[name] for name in args.workloads.split(",")}
    report = {"bench": "speculative", "machine": machine_line(), "device": args.device, "dtype": dtype,
              **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}), "k": args.k,
              "tokens": args.tokens, "requests": args.requests,
              "rounds": args.rounds, "engine": measure(loaded, workloads, args)}
    if args.replay:
        replayed: dict[str, dict] = {}
        for workload, chats in workloads.items():
            runs = greedy_outputs(loaded, chats, args.tokens)
            replayed[workload] = {"ngram": replay(NgramProposer(min_n=2, max_n=4), runs, args.k, shared=False),
                                  "suffix": replay(SuffixProposer(), runs, args.k, shared=True)}
        report["offline_replay"] = replayed
    print(json.dumps(report))


if __name__ == "__main__":
    main()
