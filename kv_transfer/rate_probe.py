"""The KV transfer rate between two processes on this host, measured with real agents over paged KV stores
(`tandem profile` and bench/kv_transfer.py share these pieces).

A receiver process holds a store and reserves blocks as a decode replica does; a sender holds a store as a prefill
replica does (in shared memory where the config turns shared memory on) and pushes every request's blocks; a round
ends when the receiver has acknowledged every request. The path is the one the agents take between replicas of one
host: "shared memory" (only the MAC'd header crosses UCX, the receiver copies straight from the sender's store;
kv_transfer/shm.py) when both agents are on it, else "transport" (gather, MAC, UCX send; receive, verify, scatter).

The receiver's messages (tuples over a multiprocessing pipe): it starts with ("ready", address), or ("error", why)
when it cannot start; then ("reserve", ids, blocks per request, tokens, sender address, shared, scattered) ->
("descs", [TransferDescriptor]); ("path",) -> ("path", kv path, shared-memory domain); ("release", ids) ->
("released", staging in use); ("stop",) ends it. An answer that fails is ("error", why).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Sequence

from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import QUANTIZED_KV_DTYPES, KVFormat


@dataclass(frozen=True)
class TransferRate:
    """One probe's result. payload_bytes: a round's KV (every request's blocks, K and V of every layer and KV
    head); seconds: the median round's, from the first send to the last acknowledgement; bytes_per_s =
    payload_bytes / seconds; path: "shared memory" or "transport"."""

    bytes_per_s: float
    payload_bytes: int
    seconds: float
    path: str
    requests: int
    tokens: int
    rounds: int

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / (self.requests * self.tokens)

    def describe(self) -> str:
        return (f"{self.bytes_per_s / 1e9:.2f} GB/s ({self.path}): {self.requests} requests x {self.tokens} tokens "
                f"({self.payload_bytes / 2**20:.1f} MiB) in {self.seconds * 1e3:.1f} ms, median of {self.rounds} "
                f"round(s); {self.seconds_per_token * 1e6:.2f} us a token")


@dataclass(frozen=True)
class Round:
    seconds: float  # first send to last acknowledgement
    latencies: dict[str, float]  # each transfer's, issue to acknowledgement


def make_store(kv: KVFormat, num_blocks: int, config: TransferConfig, *, fill: bool, device: str = "cpu",
               shared: bool = False):
    """A one-rank PagedKVCache of kv's shape: random values (fill) or zeros, every page touched now rather than
    inside a measurement. shared: in shared memory as a prefill replica's store (AgentFactory.share_kv_store: CPU
    only, and only where config.shared_memory)."""
    import torch

    from tandem.engine.kv.kv_cache import KV_STORAGE, KVCacheSpec, PagedKVCache
    from tandem.kv_transfer.agent_factory import AgentFactory

    memory = AgentFactory(config, share_kv_store=shared).store_memory(torch.device(device))
    spec = KVCacheSpec(kv.num_layers, num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim, KV_STORAGE[kv.dtype])
    cache = PagedKVCache(spec, device, memory)
    if not fill:
        cache.data.zero_()
    elif kv.dtype in QUANTIZED_KV_DTYPES:
        cache.data.view(torch.uint8).random_(0, 120)  # codes and scales alike (no fp8 NaN)
    else:
        cache.data.normal_()
    return cache


def make_agent(cache, config: TransferConfig):
    """A rank-0 agent over cache, built as engines build theirs (the UCX transport knows the store's GPU): (agent,
    layout)."""
    from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout
    from tandem.kv_transfer.agent_factory import AgentFactory

    spec = cache.spec
    layout = ReplicaLayout.build(ParallelConfig(), num_layers=spec.num_layers, num_heads=spec.num_kv_heads,
                                 num_kv_heads=spec.num_kv_heads)
    return AgentFactory(config)(0, layout, cache), layout


def ask(conn, message: tuple | None, timeout_s: float = 600.0) -> tuple:
    """Sends message to the receiver (None: nothing) and returns the receiver's next message. Raises RuntimeError
    when it reports an error, has ended or is silent for timeout_s."""
    if message is not None:
        conn.send(message)
    if not conn.poll(timeout_s):
        raise RuntimeError(f"receiver: no answer in {timeout_s:g} s")
    try:
        answer = conn.recv()
    except EOFError:
        raise RuntimeError("receiver: its process ended") from None
    if answer[0] == "error":
        raise RuntimeError(f"receiver: {answer[1]}")
    return answer


def _start(cpus: Sequence[int] | None) -> None:
    import torch

    from tandem.engine.hardware.cpu_affinity import pin_process

    torch.set_num_threads(1)  # an agent's work is copies, MACs and UCX threads
    if cpus:
        pin_process(cpus)


def receiver(conn, kv: KVFormat, max_blocks: int, device: str, config: TransferConfig,
             cpus: Sequence[int] | None = None) -> None:
    """A process target: pinned to cpus (None: where it started), reserves what the sender asks for (answering
    only the sender's agent it names) and answers as the module docstring says, until ("stop",)."""
    from tandem.kv_transfer.descriptor import TransferDescriptor

    try:
        _start(cpus)
        agent, layout = make_agent(make_store(kv, max_blocks, config, fill=False, device=device), config)
    except Exception as e:
        conn.send(("error", f"cannot start: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", agent.address))
    try:
        while (message := conn.recv())[0] != "stop":
            if message[0] == "reserve":
                _, ids, per, tokens, sender_address, shared, scattered = message
                descs, domains = [], (agent.shared_memory_domain(),) if shared else ()
                for i, transfer_id in enumerate(ids):
                    blocks = list(range(i * per, (i + 1) * per))
                    if scattered:
                        blocks = blocks[1::2] + blocks[::2]
                    deadline = time.time() + 600
                    agent.expect(transfer_id, blocks, deadline, (sender_address,))
                    descs.append(TransferDescriptor(transfer_id, layout, (agent.address,), tuple(blocks), tokens, kv,
                                                    deadline, domains))
                conn.send(("descs", descs))
            elif message[0] == "path":
                conn.send(("path", agent.stats().path, agent.shared_memory_domain()))
            elif message[0] == "release":
                for transfer_id in message[1]:
                    agent.release(transfer_id)
                conn.send(("released", agent.stats().staging_in_use))
    except EOFError:  # the sender is gone
        pass
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        agent.close()


def wait_done(agent, ids: list[str], issued: dict[str, float], timeout_s: float = 600) -> dict[str, float]:
    """Polls until every transfer is DONE; returns each one's latency in seconds (issue to acknowledgement).
    Raises RuntimeError when one ends otherwise or timeout_s passes."""
    from tandem.kv_transfer.descriptor import TransferState

    done: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        now = time.perf_counter()
        for transfer_id, status in agent.poll(ids).items():
            if transfer_id not in done and status.state.terminal:
                if status.state is not TransferState.DONE:
                    raise RuntimeError(f"transfer {transfer_id} ended {status.state.value}: {status.error}")
                done[transfer_id] = now - issued[transfer_id]
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(done)} of {len(ids)} transfers finished in {timeout_s} s")
        time.sleep(0.0002)
    return done


def push_round(agent, conn, ids: list[str], per: int, tokens: int, src_blocks: list[int], *, shared: bool,
               scattered: bool = False, timeout_s: float = 600.0) -> Round:
    """Has the receiver reserve `per` blocks for each of ids (its descriptors naming its shared-memory domain where
    shared; scattered: in no run), pushes src_blocks into each, waits for every acknowledgement and releases the
    transfers on both sides."""
    descs = ask(conn, ("reserve", ids, per, tokens, agent.address, shared, scattered), timeout_s)[1]
    issued = {}
    start = time.perf_counter()
    for desc in descs:
        issued[desc.transfer_id] = time.perf_counter()
        agent.arm(desc)
        agent.send_all(desc.transfer_id, src_blocks)
    latencies = wait_done(agent, ids, issued, timeout_s)
    seconds = time.perf_counter() - start
    for transfer_id in ids:
        agent.release(transfer_id)
    ask(conn, ("release", ids), timeout_s)
    return Round(seconds, latencies)


def _sender(conn, results, kv: KVFormat, config: TransferConfig, tokens: int, requests: int, rounds: int,
            device: str, cpus: Sequence[int] | None, timeout_s: float) -> None:
    """The probe's sender process: one uncounted round first (connections, first touches), then `rounds`; sends
    ("rate", path, seconds of each round) or ("error", why) to results."""
    try:
        _start(cpus)
        per = -(-tokens // kv.block_size)
        agent, _ = make_agent(make_store(kv, per, config, fill=True, device=device, shared=True), config)
        try:
            ask(conn, None, timeout_s)  # ready
            domain = ask(conn, ("path",), timeout_s)[2]
            shared = agent.stats().shared_memory == "on" and domain == agent.shared_memory_domain()
            seconds = [push_round(agent, conn, [f"probe-{r}-{i}" for i in range(requests)], per, tokens,
                                  list(range(per)), shared=shared, timeout_s=timeout_s).seconds
                       for r in range(rounds + 1)]
            results.send(("rate", "shared memory" if shared else "transport", seconds[1:]))
        finally:
            agent.close()
            try:
                conn.send(("stop",))
            except OSError:
                pass
    except Exception as e:
        results.send(("error", str(e) if str(e).startswith("receiver") else f"sender: {type(e).__name__}: {e}"))


def measure_transfer_rate(kv: KVFormat, config: TransferConfig, *, tokens: int = 512, requests: int = 4,
                          rounds: int = 3, device: str = "cpu", sender_cpus: Sequence[int] | None = None,
                          receiver_cpus: Sequence[int] | None = None, timeout_s: float = 60.0) -> TransferRate:
    """Starts a receiver and a sender process (spawned; pinned to receiver_cpus / sender_cpus, None: this
    process's CPUs), both agents built from config (its host must be an address of this host), with KV stores of
    kv's shape on `device`, and measures `rounds` rounds of `requests` requests of `tokens` tokens (module
    docstring). Raises ValueError for counts below 1, RuntimeError naming what failed (a process that could not
    start, a transfer that did not finish, no result in timeout_s); both processes have ended when it returns or
    raises."""
    if min(tokens, requests, rounds) < 1 or timeout_s <= 0:
        raise ValueError(f"tokens, requests and rounds must be at least 1 and timeout_s positive, got {tokens}, "
                         f"{requests}, {rounds}, {timeout_s}")
    ctx = get_context("spawn")
    sender_end, receiver_end = ctx.Pipe()
    results, results_end = ctx.Pipe(duplex=False)
    per = -(-tokens // kv.block_size)
    procs = {"receiver": ctx.Process(target=receiver, daemon=True, name="kv-probe-receiver",
                                     args=(receiver_end, kv, requests * per, device, config, receiver_cpus)),
             "sender": ctx.Process(target=_sender, daemon=True, name="kv-probe-sender",
                                   args=(sender_end, results_end, kv, config, tokens, requests, rounds, device,
                                         sender_cpus, timeout_s))}
    deadline = time.monotonic() + timeout_s
    message = None
    try:
        for proc in procs.values():
            proc.start()
        for end in (sender_end, receiver_end, results_end):
            end.close()  # the children hold theirs: a dead child's pipe now reads as ended
        while message is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"KV transfer probe: no result in {timeout_s:g} s ({_states(procs)}); stopped")
            if results.poll(min(left, 0.1)):
                try:
                    message = results.recv()
                except EOFError:
                    raise RuntimeError(f"KV transfer probe: the sender ended without a result ({_states(procs)})") \
                        from None
        if message[0] == "error":
            raise RuntimeError(f"KV transfer probe failed: {message[1]}")
    finally:
        _end(procs.values(), graceful=message is not None and message[0] == "rate")
        for end in (results, sender_end, receiver_end, results_end):
            end.close()
    _, path, seconds = message
    median = statistics.median(seconds)
    payload = requests * per * kv.num_layers * kv.num_kv_heads * kv.bytes_per_block_layer_head
    return TransferRate(payload / median, payload, median, path, requests, tokens, rounds)


def _states(procs) -> str:
    return ", ".join(f"{name} " + ("running" if p.exitcode is None else f"exited {p.exitcode}")
                     for name, p in procs.items())


def _end(procs, graceful: bool) -> None:
    """Waits a little for each started process to finish on its own (graceful), then terminates, then kills."""
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(5 if graceful else 0.1)
        if proc.is_alive():
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join()
