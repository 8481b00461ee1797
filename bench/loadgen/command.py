"""`tandem bench`: flags, then one run (open loop at --rate, closed loop at --concurrency, or a sweep when --rate
lists several rates), a summary on stderr, the results folder, and the summary JSON as stdout's last line.

    tandem bench --target 127.0.0.1:50051 --rate 2 --num-requests 200 --workload long-mix --slo ttft=2s,itl_p99=200ms
    tandem bench --openai http://127.0.0.1:8000/v1 --rate 1,2,4,8 --duration 60 --arrival gamma --burstiness 0.5
    tandem bench --target 127.0.0.1:50051 --rate 0.2 --duration 120 \
        --tenant chat,key_env=CHAT_KEY,input=lognormal:96,0.3 --tenant batch,share=5,key_env=BATCH_KEY,input=fixed:800
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from tandem.bench.loadgen.arrivals import ARRIVALS
from tandem.bench.loadgen.workloads import WORKLOADS


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate takes requests per second, or a comma-separated list for a "
                                         f"sweep, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("every --rate must be positive")
    return rates


def _tenant(text: str):
    from tandem.bench.loadgen.tenants import parse_tenant

    try:
        return parse_tenant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What is sent and when, as `tandem bench` and `tandem plan` (cluster/planner.py) both describe it: the
    arrival process, the run's length, the workload and its lengths, a trace, the seed (workload_config and
    conversations read them)."""
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="the arrival process (default poisson)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma's shape: < 1 burstier, 1 Poisson, > 1 "
                                                                 "smoother (default 1)")
    p.add_argument("--num-requests", type=int, default=None, help="arrivals per run (sessions count once)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run")
    p.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    p.add_argument("--input", default="fixed:256", help="prompt tokens: fixed:N, uniform:LO,HI or "
                                                        "lognormal:MEDIAN,SIGMA (default fixed:256)")
    p.add_argument("--output", default="fixed:64", help="output tokens, same forms (default fixed:64)")
    p.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: groups (default 4)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each group's prefix")
    p.add_argument("--long-share", type=float, default=0.1, help="long-mix: fraction of long prompts")
    p.add_argument("--long-input", default="fixed:3000", help="long-mix: long prompts' tokens (default fixed:3000)")
    p.add_argument("--turns", type=int, default=3, help="sessions: user turns per session")
    p.add_argument("--think-time", type=float, default=1.0, help="sessions: seconds between an answer and the "
                                                                 "next turn")
    p.add_argument("--trace", default=None, metavar="FILE.jsonl", help="trace: the requests and their timestamps")
    p.add_argument("--trace-time-unit", choices=["s", "ms"], default="s")
    p.add_argument("--trace-speedup", type=float, default=1.0, help="trace: replay this many times faster")
    p.add_argument("--trace-block-tokens", type=int, default=512, help="trace: tokens per hash_ids block")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals (default 0)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load a running cluster (or any OpenAI-compatible server) and measure "
                                     "TTFT, TPOT, ITL, throughput and goodput",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", metavar="HOST:PORT", help="a tandem cluster's gRPC endpoint")
    where.add_argument("--openai", metavar="URL", help="an OpenAI-compatible server (e.g. http://HOST:8000/v1)")
    p.add_argument("--api-key", default=None, help="API key (default: TANDEM_API_KEY, or OPENAI_API_KEY with "
                                                   "--openai)")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="with --target: TLS, trusting this CA")
    p.add_argument("--model", default=None, help="with --openai: the model name to send (default: the first "
                                                 "the server lists)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="the served model (HF folder or .gguf) whose "
                   "tokenizer makes the prompts (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--token-prompts", action="store_true", help="with --openai: send prompts as token id lists "
                   "(exact lengths; vLLM, llama.cpp and tandem accept them) instead of their text")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_rates, help="open loop: requests (or sessions) per second; a comma-separated "
                                                  "list runs a sweep, one run per rate (a trace gives its own times)")
    load.add_argument("--concurrency", type=int, help="closed loop: this many clients, each sending its next "
                                                      "request when its last one ends")
    add_workload_arguments(p)
    p.add_argument("--warmup", type=int, default=2, help="requests sent one at a time before measuring (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--slo", default=None, help="e.g. ttft=2s,itl_p99=200ms,tpot=50ms,e2e=30s: goodput counts "
                                               "requests meeting every one")
    p.add_argument("--attainment", type=float, default=0.9, help="for a sweep: the SLO attainment that the "
                   "highest sustainable rate must reach (DistServe's goodput; default 0.9)")
    p.add_argument("--tenant", action="append", type=_tenant, default=None, metavar="NAME,FIELD=VALUE,...",
                   help="load as several tenants at once (repeat it): fields share (its rate: --rate x share), key "
                        "or key_env (its API key), input, output; each tenant's latencies are in by_class")
    p.add_argument("--out", default=None, metavar="DIR", help="results folder (default bench-results/<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def workload_config(args):
    """The WorkloadConfig that add_workload_arguments' flags describe."""
    from tandem.bench.loadgen.workloads import WorkloadConfig, parse_length

    return WorkloadConfig(kind=args.workload, input=parse_length(args.input), output=parse_length(args.output),
                          prefix_groups=args.prefix_groups, prefix_len=args.prefix_len, long_share=args.long_share,
                          long_input=parse_length(args.long_input), turns=args.turns,
                          think_time_s=args.think_time, seed=args.seed)


def conversations(args, maker, rate: float | None, place: int = 0):
    """What one run sends (add_workload_arguments' flags): a trace's requests at its times, num_requests without
    times for a closed loop (rate None), or the workload at `rate` with the arrival process's due times. place:
    the run's place in a sweep, added to the seed, so that later runs get other prompts (none hits what an
    earlier run cached)."""
    from tandem.bench.loadgen.arrivals import ArrivalProcess
    from tandem.bench.loadgen.workloads import build, read_trace

    if args.workload == "trace":
        return read_trace(args.trace, maker, time_unit=args.trace_time_unit, speedup=args.trace_speedup,
                          block_tokens=args.trace_block_tokens, seed=args.seed)
    if rate is None:
        return build(workload_config(args), maker, [None] * (args.num_requests or 100_000))
    seed = args.seed + place
    offsets = ArrivalProcess(rate, args.arrival, args.burstiness).offsets(
        count=args.num_requests, duration_s=args.duration, seed=seed)
    return build(replace(workload_config(args), seed=seed), maker, offsets)


def _backend(args, tokenizer, api_key: str | None = None):
    """api_key: this backend's (a tenant's); None: --api-key or the environment's."""
    from tandem.bench.loadgen.backends import GrpcBackend, OpenAIBackend

    if args.target:
        return GrpcBackend(args.target, api_key=api_key or args.api_key or os.environ.get("TANDEM_API_KEY"),
                           tls_ca=args.tls_ca, timeout_s=args.timeout)
    key = api_key or args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TANDEM_API_KEY")
    return OpenAIBackend(args.openai, model=args.model, api_key=key, timeout_s=args.timeout,
                         detokenize=tokenizer.decode, token_prompts=args.token_prompts)


def _check(args) -> None:
    if args.trace is None and args.workload == "trace":
        raise ValueError("--workload trace needs --trace FILE.jsonl")
    if args.trace is not None and args.workload != "trace":
        raise ValueError("--trace replays a trace: add --workload trace")
    if args.workload == "trace" and args.rate:
        raise ValueError("a trace's timestamps are its arrival times: drop --rate (replay faster with "
                         "--trace-speedup, or ignore the timestamps with --concurrency)")
    if args.workload != "trace" and not args.rate and not args.concurrency:
        raise ValueError("say how to send: --rate R (open loop) or --concurrency N (closed loop)")
    if args.workload != "trace" and args.num_requests is None and args.duration is None:
        raise ValueError("say how long to run: --num-requests N and/or --duration S")
    if args.tenant and (not args.rate or len(args.rate) > 1 or args.duration is None or args.workload == "trace"):
        raise ValueError("--tenant runs one open loop per tenant: give one --rate and --duration (no sweep, trace or "
                         "--concurrency)")
    if args.tls_ca and not args.target:
        raise ValueError("--tls-ca is for --target (gRPC); an https:// --openai URL uses the system's CAs")


def run(args: argparse.Namespace) -> int:
    """Raises ValueError for flags that do not fit together (the CLI prints it)."""
    from tandem.bench.loadgen import report, stats
    from tandem.bench.loadgen.arrivals import ArrivalProcess
    from tandem.bench.loadgen.workloads import PromptMaker, build
    from tandem.engine.loader.model_info import load_model_info

    _check(args)
    slo = stats.parse_slo(args.slo)
    workload = workload_config(args)
    info = load_model_info(args.tokenizer)
    maker = PromptMaker(info.tokenizer, info.config.vocab_size)
    out = Path(args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}

    async def tenants(workload, maker, info):
        """--tenant: one open loop per tenant, all at once, on one clock."""
        from tandem.bench.loadgen import runner
        from tandem.bench.loadgen.arrivals import RealClock
        from tandem.bench.loadgen.tenants import run_tenants

        clock = RealClock()

        async def load(tenant, place: int):
            seed = args.seed + 1000 * (place + 1)  # each tenant its own arrivals and prompts
            offsets = ArrivalProcess(args.rate[0] * tenant.share, args.arrival, args.burstiness).offsets(
                count=args.num_requests, duration_s=args.duration, seed=seed)
            mine = replace(workload, seed=seed, input=tenant.input or workload.input,
                           output=tenant.output or workload.output)
            backend = _backend(args, info.tokenizer, tenant.key)
            try:
                return await runner.open_loop(build(mine, maker, offsets), backend, clock=clock, label=tenant.name,
                                              quiet=args.quiet)
            finally:
                await backend.aclose()

        return await run_tenants(args.tenant, load)

    async def main():
        from tandem.bench.loadgen import runner

        backend = _backend(args, info.tokenizer, args.tenant[0].key if args.tenant else None)  # the warm-up's
        try:
            first = conversations(args, maker, args.rate[0] if args.rate else None)
            # Warm-up prompts come from another seed, so that they leave nothing in the prefix caches that the
            # measured requests could hit (a trace's own rows are all there is).
            warm = first if args.workload == "trace" else build(replace(workload, seed=args.seed - 1), maker,
                                                                 [None] * max(1, args.warmup))
            failed = [r for r in await runner.warm_up(warm, backend, args.warmup) if r.error]
            if failed:
                raise RuntimeError(f"the warm-up request failed ({failed[0].error}: {failed[0].error_message}); "
                                   f"is the server at {backend.name} serving?")
            if args.tenant:
                return [(args.rate[0], await tenants(workload, maker, info))]
            if args.concurrency:
                return [(None, await runner.closed_loop(first, backend, args.concurrency, duration_s=args.duration,
                                                        quiet=args.quiet))]
            if args.workload == "trace":
                return [(None, await runner.open_loop(first, backend, label="trace", quiet=args.quiet))]
            return await runner.sweep(args.rate, lambda rate: conversations(args, maker, rate, args.rate.index(rate)),
                                      backend, quiet=args.quiet)
        finally:
            await backend.aclose()

    runs = asyncio.run(main())
    points = []
    for rate, records in runs:
        summary = stats.summarize(records, slo, asked_rate=rate)
        folder = out if len(runs) == 1 else out / f"rate-{rate:g}"
        report.write_run(folder, records, summary, config)
        points.append((rate, summary))
        print(_human(rate, summary, slo), file=sys.stderr)
    result = points[0][1] if len(points) == 1 else {
        "sweep": [{"rate": rate} | summary for rate, summary in points],
        "max_rate_meeting_slo": stats.max_rate_meeting(points, args.attainment), "attainment": args.attainment}
    if len(points) > 1:
        report.write_sweep(out, points, slo)
    print(f"tandem bench: results in {out}", file=sys.stderr)
    print(json.dumps(result | {"results": str(out)}))
    return 0


def _ms(d: dict, key: str) -> str:
    value = d.get(key)
    return "-" if value is None else f"{value:.0f}"


def _human(rate, summary: dict, slo) -> str:
    """A few lines for a person; the JSON has everything."""
    lines = [f"== {'closed loop' if rate is None else f'{rate:g} req/s asked'}: {summary['completed']} of "
             f"{summary['requests']} completed, achieved rate {summary.get('achieved_rate') or 0:.2f} req/s, "
             f"pacing p99 {_ms(summary['pacing_ms'], 'p99')} ms"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = summary[name]
        lines.append(f"   {name[:-3]:5s} ms  mean {_ms(d, 'mean')}  p50 {_ms(d, 'p50')}  p90 {_ms(d, 'p90')}  "
                     f"p99 {_ms(d, 'p99')}  max {_ms(d, 'max')}")
    lines.append(f"   throughput {summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} "
                 f"output tok/s; goodput {summary['goodput_rps']:.2f} req/s"
                 + (f" ({100 * summary['slo_attainment']:.0f}% within {slo.describe()})" if slo else ""))
    if summary["errors"]:
        lines.append(f"   errors: {summary['errors']}")
    return "\n".join(lines)
