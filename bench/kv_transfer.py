"""KV transfer throughput and layer-wise pipelining between two processes on this host.

Batched transfers: a sender and a receiver process, each one rank with the embedded model's KV shape
(SmolLM2-135M: 30 layers x 3 KV heads x 64, 16-token blocks, float32 as the engine keeps it). The receiver
reserves blocks for --requests requests of --tokens tokens each (for 1, 16 and 256 requests by default), the
sender pushes them all, and a request counts as done when the receiver has acknowledged it. Two paths, rounds
interleaved in one run: "shared memory" (the descriptors name the receiver's shared-memory domain, as a decode
replica's do; the sender's KV store is shared memory, as a prefill replica's is: only the MAC'd header and a ref
cross UCX, and the receiver copies each run of blocks straight from the sender's store into its own, one copy
in all; kv_transfer/shm.py) and "transport" (no domain: gather, keyed BLAKE3 MAC, UCX send; receive, verify,
scatter). Each request's blocks are one run on both sides, as a fresh request's are; --scattered permutes them,
so the shared-memory path goes through the sender's shared staging instead (gather there, the receiver copies
from the slot: two copies). Reported: payload GB/s, the
per-request latency (issue to acknowledgement; p50 and max), and a plain memory copy of the same bytes in the
same run (np.copyto, request-sized chunks into a buffer far larger than the caches) as the peer: the ratio is
transfer rate / memcpy rate. A second peer, the bare transport (16 MiB tagged messages between two processes,
nothing gathered, checked or scattered), shows what the agents' own work costs.

--device cuda puts both agents' KV stores on the GPU (the agents pick their path: pinned host staging, or
device-side slots where UCX moves device memory between processes; reported as "path"). The memcpy peer is then
replaced by two GPU peers on the same bytes in the same run: a device-to-device copy (torch copy_ on the GPU)
and a device-to-host copy into pinned memory, request-sized chunks each.

Layer-wise pipelining: the sender runs the embedded model's prefill of a --prefill-tokens prompt in one step
with the agent sending each layer as soon as it is computed; exposed = time from the end of that step to the
receiver's acknowledgement. The same bytes are then sent again with no compute (standalone transfer time).
Hidden share = 1 - exposed / standalone.

    .venv/bin/python bench/kv_transfer.py [--requests 1 16 256] [--tokens 512] [--prefill-tokens 2048] [--rounds 3]
                                          [--device cpu|cuda] [--scattered]

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from multiprocessing import get_context

from tandem.kv_transfer.descriptor import KVFormat
from tandem.kv_transfer.rate_probe import ask, make_agent, make_store, push_round, receiver, wait_done

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
KV = KVFormat(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, "float32")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def agents_config(secret: bytes):
    """Both agents' settings (the sender's store in shared memory, as a prefill replica's)."""
    from tandem.kv_transfer.config import TransferConfig

    return TransferConfig(staging_bytes=256 << 20, secret=secret, shared_memory=True)


def memcpy_rate(nbytes: int, chunk: int, rounds: int) -> float:
    """GB/s of np.copyto moving nbytes in chunk-sized copies into a buffer of at least 1 GiB (past the caches)."""
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    ring = np.ones(max(1 << 30, chunk) // chunk * chunk, dtype=np.uint8)
    slots = len(ring) // chunk
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(nbytes // chunk):
            j = i % slots
            np.copyto(ring[j * chunk:(j + 1) * chunk], src)
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def cuda_copy_rates(nbytes: int, chunk: int, rounds: int) -> tuple[float, float]:
    """GB/s of torch copy_ on the GPU moving nbytes in chunk-sized copies into a ring of at least 1 GiB:
    (device to device, device to pinned host)."""
    import torch

    src = torch.randint(0, 255, (chunk,), dtype=torch.uint8, device="cuda")
    slots = max(1, (1 << 30) // chunk)
    rates = []
    for ring in (torch.empty(slots * chunk, dtype=torch.uint8, device="cuda"),
                 torch.empty(slots * chunk, dtype=torch.uint8, pin_memory=True)):
        ring.fill_(1)  # touch every page now, not inside the measurement
        best = 0.0
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(max(1, nbytes // chunk)):
                j = i % slots
                ring[j * chunk:(j + 1) * chunk].copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = max(best, max(1, nbytes // chunk) * chunk / (time.perf_counter() - start) / 1e9)
        rates.append(best)
    return rates[0], rates[1]


def _raw_receiver(conn, chunk: int, count: int) -> None:
    import numpy as np

    from tandem.kv_transfer.config import TransferConfig
    from tandem.kv_transfer.ucx_transport import UCXTransport

    transport = UCXTransport("127.0.0.1", 0, TransferConfig().ucx_env)
    conn.send(transport.address)
    buffer = np.empty(chunk, dtype=np.uint8)
    for _ in range(count):
        while (probe := transport.probe(0, 0)) is None:
            time.sleep(0.0001)
        handle = transport.receive(probe, buffer)
        while not handle.done():
            time.sleep(0.0001)
    conn.send("received")
    conn.recv()


def raw_ucx_rate(nbytes: int, chunk: int) -> float:
    """GB/s of the bare transport between two processes: chunk-sized tagged messages, received into one
    reused buffer; no gather, MAC or scatter (the ceiling the agents work under)."""
    import numpy as np

    from tandem.kv_transfer.config import TransferConfig
    from tandem.kv_transfer.ucx_transport import UCXTransport

    count = max(1, nbytes // chunk)
    ctx = get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(there, chunk, count), daemon=True)
    proc.start()
    peer = here.recv()
    transport = UCXTransport("127.0.0.1", 0, TransferConfig().ucx_env)
    data = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    start = time.perf_counter()
    handles = [transport.send(peer, i + 1, data) for i in range(count)]
    assert here.recv() == "received"
    elapsed = time.perf_counter() - start
    assert all(h.done() and h.error() is None for h in handles)
    here.send("stop")
    proc.join(timeout=30)
    transport.close()
    return nbytes / elapsed / 1e9


def batched(agent, conn, requests: int, tokens: int, rounds: int, src_blocks: list[int], device: str,
            paths: list[str], scattered: bool) -> dict:
    """Every path's rate (median of rounds, the paths' rounds interleaved) against the peers; the first path's
    is transfer_GBps."""
    per = -(-tokens // BLOCK)
    payload = LAYERS * KV_HEADS * per * 2 * BLOCK * HEAD_DIM * 4
    rates = {path: [] for path in paths}
    latencies = {path: [] for path in paths}
    by_reference = {path: 0 for path in paths}
    from_store = agent.stats().from_store
    for r in range(rounds):
        for path in paths:
            ids = [f"b{requests}-{r}-{path}-{i}" for i in range(requests)]
            sent_by_reference = agent.stats().by_reference
            pushed = push_round(agent, conn, ids, per, tokens, src_blocks, shared=path == "shared memory",
                                scattered=scattered)
            rates[path].append(requests * payload / pushed.seconds / 1e9)
            latencies[path].extend(pushed.latencies.values())
            by_reference[path] += agent.stats().by_reference - sent_by_reference
    from_store = agent.stats().from_store - from_store
    raw = raw_ucx_rate(min(requests, 64) * payload, 16 << 20)
    rate = statistics.median(rates[paths[0]])
    result = {"requests": requests, "tokens": tokens, "bytes_per_request": payload, "path": paths[0],
              "transfer_GBps": round(rate, 3)}
    if device == "cuda":
        d2d, d2h = cuda_copy_rates(requests * payload, payload, rounds)
        result.update({"d2d_GBps": round(d2d, 3), "ratio_to_d2d": round(rate / d2d, 3),
                       "d2h_pinned_GBps": round(d2h, 3), "ratio_to_d2h": round(rate / d2h, 3)})
        peers = f"GPU copy {d2d:.2f} GB/s (ratio {rate / d2d:.3f}), to pinned host {d2h:.2f} GB/s " \
                f"(ratio {rate / d2h:.2f})"
    else:
        copy = memcpy_rate(requests * payload, payload, rounds)
        result.update({"memcpy_GBps": round(copy, 3), "ratio": round(rate / copy, 3)})
        peers = f"memcpy {copy:.2f} GB/s (ratio {rate / copy:.2f})"
    result.update({"raw_ucx_GBps": round(raw, 3), "ratio_to_raw_ucx": round(rate / raw, 3),
                   "messages_from_store": from_store,
                   "latency_ms_p50": round(1e3 * statistics.median(latencies[paths[0]]), 2),
                   "latency_ms_max": round(1e3 * max(latencies[paths[0]]), 2),
                   "rates_GBps": [round(x, 3) for x in rates[paths[0]]]})
    result["paths"] = {path: {"GBps": round(statistics.median(rates[path]), 3),
                              "ratio_to_first": round(statistics.median(rates[path]) / rate, 3),
                              "latency_ms_p50": round(1e3 * statistics.median(latencies[path]), 2),
                              "messages_by_reference": by_reference[path]} for path in paths}
    if device != "cuda":
        for row in result["paths"].values():
            row["ratio_to_memcpy"] = round(row["GBps"] / copy, 3)
    log(f"{requests:4d} x {tokens} tokens: {rate:.2f} GB/s ({paths[0]}) vs {peers}, bare UCX {raw:.2f} GB/s "
        f"(ratio {rate / raw:.2f}), latency p50 {result['latency_ms_p50']} ms, max {result['latency_ms_max']} ms; "
        + ", ".join(f"{path}: {row['GBps']:.2f} GB/s" for path, row in result["paths"].items()))
    return result


def pipelining(conn, prefill_tokens: int, rounds: int, device: str, secret: bytes, shared: bool) -> dict:
    """The embedded model's prefill with layer-wise sends vs the same transfer alone (see the docstring);
    shared: through shared memory (as between replicas of one host), else through the transport."""
    import torch

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.loader import load_model
    from tandem.engine.sampling_params import SamplingParams
    from tandem.kv_transfer.agent_factory import AgentFactory

    torch.set_num_threads(1)  # the receiver process and the UCX threads get the other core
    config = agents_config(secret)  # layer_group 1: each layer leaves as soon as it is written
    engine = LLMEngine(load_model(progress=False, device=device),
                       EngineConfig(num_kv_blocks=4 * (prefill_tokens // BLOCK + 2),
                                    max_num_batched_tokens=prefill_tokens),
                       kv_agent=AgentFactory(config, share_kv_store=shared))
    agent = engine.executor.agent
    per = -(-prefill_tokens // BLOCK)
    rows = []
    for r in range(rounds):
        prompt = [(7 * i + r) % 40000 + 100 for i in range(prefill_tokens)]
        ids = [f"p-{r}", f"alone-{r}"]
        piped, alone = ask(conn, ("reserve", ids, per, prefill_tokens, agent.address, shared, False))[1]
        agent.arm(piped, seq_id=f"prompt-{r}#0")
        engine.hold_blocks_after(f"prompt-{r}", piped.transfer_id)  # as PrefillConnector does: read in place
        engine.add_request(f"prompt-{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
        start = time.perf_counter()
        engine.step()
        computed = time.perf_counter()
        wait_done(agent, [piped.transfer_id], {piped.transfer_id: start})
        exposed = time.perf_counter() - computed
        agent.arm(alone)
        issued = time.perf_counter()
        agent.send_all(alone.transfer_id, agent.source_blocks(piped.transfer_id))
        standalone = wait_done(agent, [alone.transfer_id], {alone.transfer_id: issued})[alone.transfer_id]
        for transfer_id in (piped.transfer_id, alone.transfer_id):
            agent.release(transfer_id)
        engine.release_held_blocks(piped.transfer_id)
        ask(conn, ("release", [piped.transfer_id, alone.transfer_id]))
        rows.append({"compute_s": computed - start, "exposed_s": exposed, "standalone_s": standalone,
                     "hidden": 1 - exposed / standalone})
        log(f"prefill {prefill_tokens} tokens: compute {computed - start:.3f} s, transfer alone {standalone:.3f} s, "
            f"exposed after compute {exposed * 1e3:.1f} ms -> {100 * (1 - exposed / standalone):.1f}% hidden")
    engine.shutdown()
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return {"prefill_tokens": prefill_tokens, "compute_s": round(med["compute_s"], 3),
            "transfer_alone_s": round(med["standalone_s"], 4), "exposed_s": round(med["exposed_s"], 4),
            "hidden_share": round(med["hidden"], 3), "hidden_per_round": [round(r["hidden"], 3) for r in rows]}


def sender(conn, address: str, args, secret: bytes) -> None:
    import torch

    torch.set_num_threads(1)
    per = -(-args.tokens // BLOCK)
    config = agents_config(secret)
    agent, _ = make_agent(make_store(KV, per, config, fill=True, device=args.device, shared=True), config)
    _, receiver_path, receiver_domain = ask(conn, ("path",))
    paths = {"sender": agent.stats().path, "receiver": receiver_path,
             "shared_memory": {"sender": agent.stats().shared_memory, "receiver_domain": bool(receiver_domain)}}
    shared = agent.stats().shared_memory == "on" and receiver_domain == agent.shared_memory_domain()
    compared = ["shared memory", "transport"] if shared else ["transport"]
    log(f"KV stores on {args.device}; transfer paths: {paths}; compared: {compared}")
    src_blocks = list(range(per))
    if args.scattered:
        src_blocks = src_blocks[::-1]
    results = {"batched": [batched(agent, conn, n, args.tokens, args.rounds, src_blocks, args.device, compared,
                                   args.scattered) for n in args.requests]}
    agent.close()
    if args.prefill_tokens:
        results["pipelining"] = pipelining(conn, args.prefill_tokens, args.rounds, args.device, secret, shared)
    conn.send(("stop",))
    print(json.dumps({"peer_address": address, "device": args.device, "paths": paths, **results}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="0 skips the pipelining measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where both agents' KV stores live (cuda: the GPU, compared with GPU copies)")
    parser.add_argument("--scattered", action="store_true",
                        help="blocks in no run on either side (the copies go through index_select / index_copy_)")
    args = parser.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # checked here: the processes below would fail one by one
            parser.error(f"--device cuda needs a CUDA GPU, and this torch ({torch.__version__}) sees none "
                         f"(torch.cuda.is_available() is False); run with --device cpu")
    ctx = get_context("spawn")
    to_receiver, receiver_end = ctx.Pipe()
    max_blocks = max(max(args.requests) * -(-args.tokens // BLOCK), 2 * -(-args.prefill_tokens // BLOCK))
    log(f"receiver store: {max_blocks} blocks ({max_blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4 / 2**30:.1f} "
        f"GiB); sender in this process")
    secret = secrets.token_bytes(32)  # the transfer secret both agents share, as a cluster's replicas do
    proc = ctx.Process(target=receiver, args=(receiver_end, KV, max_blocks, args.device, agents_config(secret)),
                       daemon=True)
    proc.start()
    _, address = ask(to_receiver, None)
    sender(to_receiver, address, args, secret)
    proc.join(timeout=30)


if __name__ == "__main__":
    main()
