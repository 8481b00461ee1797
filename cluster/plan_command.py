"""`tandem plan`: flags, the planner's search (cluster/planner.py) with progress on stderr, a table of what it
predicted, the best deployment written as a manifest (--out), and every prediction as stdout's last line (JSON).

    tandem plan --profile deploy/profiles/cpu-2core-avx2-bench-disaggregated.json \\
        --profile deploy/profiles/cpu-2core-avx2-bench-colocated.json --workload long-mix --rate 0.12 --duration 120 \\
        --input lognormal:96,0.4 --long-share 0.15 --long-input uniform:1024,1536 --output fixed:48 \\
        --slo ttft=20s,itl_p99=500ms --out planned.yaml
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate takes requests per second, got {text!r}") from None
    if rate <= 0:
        raise argparse.ArgumentTypeError("--rate must be positive")
    return rate


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tandem.bench.loadgen.command import add_workload_arguments

    p = sub.add_parser("plan", help="choose the deployment (colocated or disaggregated, prefill:decode ratio, batch "
                                    "limits) for a workload and an SLO, by simulation from profiles",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--profile", action="append", required=True, metavar="FILE",
                   help="a profile from `tandem profile` (repeat it: the deployments of every profile compete)")
    p.add_argument("--rate", type=_rate, default=None, help="requests per second (a trace gives its own times)")
    add_workload_arguments(p)
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="the tokenizer that makes the prompts, as "
                   "`tandem bench` (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--slo", default=None, help="e.g. ttft=2s,itl_p99=200ms: goodput counts requests meeting every "
                                               "one")
    p.add_argument("--budget", type=int, default=None, help="cores (CPU profiles) or GPUs the deployment may take "
                   "(default: what the largest profiled manifest's replicas take)")
    p.add_argument("--out", default=None, metavar="FILE.yaml", help="write the best deployment as a manifest")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def _check(args) -> None:
    if args.workload == "trace" and (args.trace is None or args.rate):
        raise ValueError("--workload trace takes --trace FILE.jsonl and its own times (no --rate)")
    if args.workload != "trace" and (not args.rate or (args.num_requests is None and args.duration is None)):
        raise ValueError("say what to plan for: --rate R and --duration S and/or --num-requests N")


def run(args: argparse.Namespace) -> int:
    """Raises ValueError for flags that do not fit together or a bad profile (the CLI prints it)."""
    from tandem.bench.loadgen.command import conversations
    from tandem.bench.loadgen.stats import parse_slo
    from tandem.bench.loadgen.workloads import PromptMaker
    from tandem.cluster.hardware_profile import read_profile
    from tandem.cluster.planner import Planner, budget_unit, default_budget, manifest_text
    from tandem.engine.loader.model_info import load_model_info

    _check(args)
    profiles = [read_profile(path) for path in args.profile]
    unit = budget_unit(profiles)
    budget = args.budget or default_budget(profiles)
    slo = parse_slo(args.slo)
    info = load_model_info(args.tokenizer)
    sent = conversations(args, PromptMaker(info.tokenizer, info.config.vocab_size), args.rate)
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    say(f"tandem plan: {sum(len(c.requests) for c in sent)} requests, {budget} {unit}, {slo.describe()}")
    started = time.perf_counter()
    ranked = Planner(profiles, sent, args.rate, slo, budget, say).plan()
    if not ranked:
        raise ValueError(f"no profiled deployment fits in {budget} {unit}")
    say(f"{len(ranked)} deployments simulated in {time.perf_counter() - started:.1f} s; best first:")
    for i, p in enumerate(ranked[:8]):
        say(f"  {i + 1}. {_line(p)} ({p.option.units} {unit})")
    best = ranked[0]
    result = {"budget": budget, "unit": unit, "slo": slo.describe(), "rate": args.rate,
              "best": best.figures(), "ranked": [p.figures() for p in ranked]}
    if args.out:
        header = [f"planned by: tandem plan {shlex.join(sys.argv[2:])}" if sys.argv[1:2] == ["plan"] else
                  "planned by tandem plan",
                  f"predicted ({slo.describe()}): {_line(best)}",
                  *[f"runner-up {i}: {_line(p)}" for i, p in enumerate(ranked[1:4], 1)]]
        Path(args.out).write_text(manifest_text(best, header))
        result["manifest"] = args.out
        say(f"tandem plan: wrote {best.option.describe()} to {args.out}")
    print(json.dumps(result))
    return 0


def _line(prediction) -> str:
    from tandem.cluster.planner import format_ms

    f = prediction.figures()
    return (f"{f['deployment']}: goodput {f['goodput_rps']:.3f} req/s ({100 * f['slo_attainment']:.0f}%), "
            f"TTFT p90 {format_ms(f['ttft_p90_ms'])}, ITL p99 {format_ms(f['itl_p99_ms'])}")
