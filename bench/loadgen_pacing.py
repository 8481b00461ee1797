"""Does `tandem bench` send at the rate it is asked for? Its pacer against the fixed-sleep sender other tools used
(vLLM #21104: a sender that slept 1/rate after each send delivered 183.5 req/s for 200 asked), in one run, on the
same requests, against the same server: the router's gRPC front door over a mock replica (router/mocks/front.py,
in its own process; 2 ms a token, 4 tokens a request), constant arrivals at each --rates rate for --seconds.

For each sender: the achieved rate ((n - 1) / (last send - first send)), the p99 of send lateness (actual minus
due time), and TTFT p99 measured from the due time and from the actual send: the gap between the two is what
a benchmark that times from the send hides (coordinated omission).

    .venv/bin/python bench/loadgen_pacing.py [--rates 50,100,200,400] [--seconds 4]

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.machine import machine_line  # noqa: E402
from tandem.bench.loadgen.arrivals import ArrivalProcess, RealClock  # noqa: E402
from tandem.bench.loadgen.backends import GrpcBackend  # noqa: E402
from tandem.bench.loadgen.records import RequestRecord, WorkRequest  # noqa: E402
from tandem.bench.loadgen.runner import open_loop  # noqa: E402
from tandem.bench.loadgen.stats import describe, summarize  # noqa: E402
from tandem.bench.loadgen.workloads import Conversation  # noqa: E402


def serve(conn) -> None:
    """The mock front door, in its own process: sends its gRPC target, serves until told to stop."""
    from tandem.engine.loader.model_info import load_model_info
    from tandem.router.mocks.front import MockFront
    from tandem.router.mocks.replicas import MockDecode
    from tandem.router.request_parsing import ModelFacts

    info = load_model_info(None)
    front = MockFront(MockDecode("decode-0", step_s=0.002), ModelFacts("mock", info.tokenizer,
                                                                       info.config.vocab_size, 2048))
    conn.send(front.target)
    conn.recv()
    front.close()


async def fixed_sleep(conversations, backend, rate: float) -> list[RequestRecord]:
    """The sender to beat: start a request, sleep 1/rate, repeat. Due times are still i/rate, to measure it."""
    clock, tasks, records = RealClock(), [], []
    for i, conversation in enumerate(conversations):
        record = RequestRecord(i, conversation.at_s)
        records.append(record)
        tasks.append(asyncio.ensure_future(backend.send(conversation.requests[0], record, clock)))
        await asyncio.sleep(1.0 / rate)
    await asyncio.gather(*tasks)
    return records


def measure(records: list[RequestRecord]) -> dict:
    s = summarize(records)
    from_send = describe(1000 * (r.first_token_s - r.sent_s) for r in records if r.ok)
    return {"achieved_rate": s["achieved_rate"], "pacing_p99_ms": s["pacing_ms"]["p99"],
            "ttft_p99_ms_from_due": s["ttft_ms"]["p99"], "ttft_p99_ms_from_send": from_send["p99"],
            "completed": s["completed"], "requests": s["requests"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")], default=[50, 100, 200, 400])
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    parent, child = multiprocessing.get_context("spawn").Pipe()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(child,), daemon=True)
    server.start()
    target = parent.recv()
    results = {"machine": machine_line(), "seconds": args.seconds, "rates": {}}

    async def run(rate: float) -> dict:
        backend = GrpcBackend(target, timeout_s=60)
        try:
            offsets = ArrivalProcess(rate, "constant").offsets(duration_s=args.seconds)
            conversations = [Conversation(at, (WorkRequest(4, prompt_ids=tuple(range(1000, 1016))),))
                             for at in offsets]
            await open_loop(conversations[:20], backend, quiet=True)  # warm-up
            paced = measure(await open_loop(conversations, backend, quiet=True))
            slept = measure(await fixed_sleep(conversations, backend, rate))
            return {"tandem_bench": paced, "fixed_sleep": slept,
                    "achieved_ratio": paced["achieved_rate"] / slept["achieved_rate"]}
        finally:
            await backend.aclose()

    try:
        for rate in args.rates:
            results["rates"][f"{rate:g}"] = row = asyncio.run(run(rate))
            print(f"{rate:g} req/s asked: tandem bench {row['tandem_bench']['achieved_rate']:.1f} (pacing p99 "
                  f"{row['tandem_bench']['pacing_p99_ms']:.1f} ms), fixed sleep {row['fixed_sleep']['achieved_rate']:.1f}",
                  file=sys.stderr, flush=True)
    finally:
        parent.send("stop")
        server.join(30)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
