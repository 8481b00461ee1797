"""`tandem bench`: an open-loop load generator for a tandem cluster (gRPC) or any OpenAI-compatible server.

    arrivals.py   when each request is due (constant, Poisson, gamma) and the pacer that sends it then
    workloads.py  what each request asks (synthetic lengths, shared prefixes, long-prompt mix, sessions, traces)
    backends.py   how it is sent and timed (gRPC streaming, OpenAI SSE)
    records.py    what one request's run left behind (RequestRecord: one JSONL row)
    stats.py      latency statistics, SLOs, goodput
    runner.py     open loop, closed loop and rate sweeps
    report.py     the results folder: per-request JSONL, summary JSON, PNG plots
    command.py    the `tandem bench` command line

This package imports only the router's client, the proto and the engine's torch-free tokenizer, so that the
`tandem` command can offer it without pulling in the cluster.
"""
