"""Scheduling for many tenants on virtual time: the engine's own Scheduler and KV cache manager
(engine/core/scheduler.py, scheduling_policy.py), stepped on a clock that a step cost model advances instead of a
model, so that a policy's effect is measured over minutes of load in a second and the same in every run.

Two questions (issue 50), each answered by runs of the same arrivals under different policies:

  tenants   a steady interactive tenant (--rate requests/s, short prompts) alone, then with a batch tenant at
            --batch-factor times its rate (long prompts), under fcfs and under fair: the interactive tenant's
            TTFT p50/p99 in each, and its p99 against alone (the target: fair within 2x, fcfs not); with
            --fair-reserve-s, fair with that fair_reserve_s too.
  long-mix  one tenant, mostly short prompts and --long-share long ones, under fcfs and sjf (aging
            --aging-s): mean and p99 TTFT, and the longest any request waited to be first scheduled.

The step cost model (seconds): --step-ms, plus --prefill-us-per-token for each prompt token computed, plus
--decode-ms-per-seq for each decoding sequence. Its defaults are the embedded model's rough costs on a 2-core
CPU (one decode step 20-25 ms, prefill about 2,000 tokens/s); the policies' ranking, not the absolute times, is
what this measures. The last line of output is one JSON object with every number.

    .venv/bin/python bench/tenant_scheduling.py [--duration 600] [--rate 0.3] [--batch-factor 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass, field

from tandem.engine.core.kv_cache_manager import KVCacheManager
from tandem.engine.core.scheduler import Scheduler
from tandem.engine.engine_config import SchedulerConfig, SchedulingConfig
from tandem.engine.request import Sequence
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput

BLOCK = 16


@dataclass(frozen=True)
class Arrival:
    at: float
    tenant: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Costs:
    step_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float

    def step(self, out: SchedulerOutput, decoding: int) -> float:
        prefill = out.total_num_scheduled_tokens - decoding
        return self.step_s + prefill * self.prefill_s_per_token + decoding * self.decode_s_per_seq


@dataclass
class Served:
    arrival: Arrival
    started: float | None = None  # first scheduled
    first: float | None = None  # first token


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    served: dict[str, Served] = field(default_factory=dict)


def simulate(arrivals: list[Arrival], scheduling: SchedulingConfig, costs: Costs, *, max_num_seqs: int = 32,
             budget: int = 512, blocks: int = 8192) -> Run:
    """Every arrival through a Scheduler on virtual time; what each request saw."""
    clock = Clock()
    config = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             scheduling=scheduling)
    scheduler = Scheduler(config, KVCacheManager(blocks, BLOCK), frozenset(), clock=clock)
    run, pending = Run(), sorted(arrivals, key=lambda a: a.at)
    i = 0
    while i < len(pending) or scheduler.has_unfinished():
        while i < len(pending) and pending[i].at <= clock.now:
            a, rid = pending[i], f"r{i}"
            params = SamplingParams(max_tokens=a.output_tokens, temperature=0, ignore_eos=True)
            prompt = tuple(1000 + (i * 7919 + k) % 30000 for k in range(a.prompt_tokens))  # no shared prefixes
            scheduler.add(Sequence(f"{rid}#0", rid, 0, prompt, params, i, 0, i, None, BLOCK, tenant=a.tenant))
            run.served[rid] = Served(a)
            i += 1
        if not scheduler.has_schedulable():
            clock.now = pending[i].at
            continue
        out = scheduler.schedule()
        for seq_id in out.num_scheduled_tokens:
            served = run.served[seq_id.partition("#")[0]]
            served.started = clock.now if served.started is None else served.started
        sampled, decoding = {}, 0
        for seq_id, count in out.num_scheduled_tokens.items():
            seq = scheduler.seqs[seq_id]
            decoding += seq.num_tokens - seq.num_computed_tokens == 1
            if seq.num_computed_tokens + count == seq.num_tokens:
                sampled[seq_id] = SampledToken(7, None, ())
        clock.now += costs.step(out, decoding)
        for update in scheduler.update(out, RunnerOutput(sampled)):
            served = run.served[update.seq.request_id]
            served.first = clock.now if served.first is None else served.first
    return run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def ttfts(run: Run, tenant: str | None = None) -> list[float]:
    return [s.first - s.arrival.at for s in run.served.values() if tenant is None or s.arrival.tenant == tenant]


def tenants(args, costs: Costs) -> dict:
    rng = random.Random(args.seed)
    chat = [Arrival(t, "chat", max(16, round(rng.lognormvariate(4.8, 0.3))), 32)
            for t in poisson(rng, args.rate, args.duration)]
    batch = [Arrival(t, "batch", rng.randint(600, 1000), 64)
             for t in poisson(rng, args.rate * args.batch_factor, args.duration)]
    result = {}
    runs = [("alone", chat, SchedulingConfig(policy="fcfs")), ("fcfs", chat + batch, SchedulingConfig(policy="fcfs")),
            ("fair", chat + batch, SchedulingConfig(policy="fair"))]
    if args.fair_reserve_s:
        runs.append(("fair_reserve", chat + batch, SchedulingConfig(policy="fair", fair_reserve_s=args.fair_reserve_s)))
    for name, arrivals, scheduling in runs:
        run = simulate(arrivals, scheduling, costs, budget=args.budget)
        chat_ttft, batch_ttft = ttfts(run, "chat"), ttfts(run, "batch")
        result[name] = {"chat_ttft_p50_s": percentile(chat_ttft, 0.5), "chat_ttft_p99_s": percentile(chat_ttft, 0.99),
                        "batch_ttft_p50_s": percentile(batch_ttft, 0.5) if batch_ttft else None,
                        "batch_ttft_p99_s": percentile(batch_ttft, 0.99) if batch_ttft else None,
                        "requests": len(run.served)}
        print(f"tenants {name}: {json.dumps(result[name])}", file=sys.stderr, flush=True)
    for name, _, _ in runs[1:]:
        result[f"{name}_chat_p99_vs_alone"] = result[name]["chat_ttft_p99_s"] / result["alone"]["chat_ttft_p99_s"]
    result["requests"] = {"chat": len(chat), "batch": len(batch)}
    return result


def long_mix(args, costs: Costs) -> dict:
    rng = random.Random(args.seed + 1)
    arrivals = [Arrival(t, "one", rng.randint(1024, 1536) if rng.random() < args.long_share
                        else max(16, round(rng.lognormvariate(4.56, 0.4))), 48)
                for t in poisson(rng, args.long_mix_rate, args.duration)]
    result = {}
    for policy in ("fcfs", "sjf"):
        run = simulate(arrivals, SchedulingConfig(policy=policy, sjf_aging_s=args.aging_s), costs, budget=args.budget)
        values = ttfts(run)
        waits = [s.started - s.arrival.at for s in run.served.values()]
        result[policy] = {"ttft_mean_s": statistics.mean(values), "ttft_p99_s": percentile(values, 0.99),
                          "longest_wait_s": max(waits), "requests": len(values)}
        print(f"long-mix {policy}: {json.dumps(result[policy])}", file=sys.stderr, flush=True)
    result["sjf_mean_ttft_vs_fcfs"] = result["sjf"]["ttft_mean_s"] / result["fcfs"]["ttft_mean_s"]
    result["aging_s"] = args.aging_s
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals (virtual)")
    parser.add_argument("--rate", type=float, default=0.3, help="the interactive tenant's requests/s")
    parser.add_argument("--batch-factor", type=float, default=5.0, help="the batch tenant's rate, in interactive's")
    parser.add_argument("--long-mix-rate", type=float, default=1.8, help="long-mix's requests/s")
    parser.add_argument("--long-share", type=float, default=0.15)
    parser.add_argument("--aging-s", type=float, default=10.0, help="sjf's aging bound")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--prefill-us-per-token", type=float, default=500.0)
    parser.add_argument("--decode-ms-per-seq", type=float, default=1.0)
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens: a step's tokens")
    parser.add_argument("--fair-reserve-s", type=float, default=0.0,
                        help="tenants: also run fair with this fair_reserve_s (0: not)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="tenants,long-mix")
    args = parser.parse_args()
    costs = Costs(args.step_ms / 1e3, args.prefill_us_per_token / 1e6, args.decode_ms_per_seq / 1e3)
    results = {"duration_s": args.duration, "seed": args.seed, "costs": vars(costs), "budget": args.budget}
    modes = {"tenants": tenants, "long-mix": long_mix}
    for mode in args.modes.split(","):
        results[mode] = modes[mode](args, costs)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
