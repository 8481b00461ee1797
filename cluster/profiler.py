"""`tandem profile MANIFEST`: measures, on the hardware at hand, what choosing a deployment needs from each pool of
the manifest, built as `tandem up` would build one of its replicas (cluster/replica_plans.py: the same parallel
layout, device, dtype, weight format, threads, CPU pinning, token budget and compile setting), and writes it as a
profile (cluster/hardware_profile.py):

- prefill: for each prompt length and number of prompts submitted together, the seconds until every first token
  (chunked by the pool's token budget, as the replica would), best of `repeats`;
- decode: for each batch size and context, the median of `decode_steps` timed decode steps;
- the KV bytes a token takes in the pool's cache;
- for a disaggregated manifest, the KV transfer rate: measured (kv_transfer/rate_probe.py) between a sender and a
  receiver process on this host, agents built from the manifest's transport section as the replicas' are, over KV
  stores of the model's shape in the KV dtype transfers carry, pinned to the pools' CPUs; or given
  (--transfer-bytes-per-s). A colocated manifest moves no KV: the file records DESIGN.md section 4's loopback UCX
  figure, named as such.

Points that do not fit the pool (a prompt beyond max_model_len, a batch beyond max_num_seqs or its KV beyond the
pool's blocks) are left out, and said so. Prompts are distinct token sequences and prefix caching is off while
profiling, so no point is served from cache; speculation and KV tiers are off (they are workload-dependent);
`compile: background` is measured compiled (what the replica runs once it has compiled).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import platform
import secrets
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

from tandem.cluster.hardware_profile import (UCX_LOOPBACK_BYTES_PER_S, DecodePoint, Layout, PoolProfile,
                                             PrefillPoint, Profile, Transfer, fit_points)
from tandem.cluster.manifest import Manifest
from tandem.cluster.replica_plans import replica_spec, transfer_config
from tandem.kv_transfer.rate_probe import measure_transfer_rate

# What the transfer probe pushes each round (after one uncounted round): a few prompts' KV, ~90 MiB on the
# embedded model, so that a round takes tens to hundreds of milliseconds on a 2-core CPU.
PROBE_REQUESTS, PROBE_TOKENS, PROBE_ROUNDS = 4, 512, 3


@dataclasses.dataclass(frozen=True)
class Grid:
    """What to measure. prompts: prompt lengths (tokens); prompt_counts: prompts submitted together; batches:
    decode batch sizes; contexts: decode contexts (tokens per sequence)."""

    prompts: tuple[int, ...] = (128, 512, 1536)
    prompt_counts: tuple[int, ...] = (1, 4)
    batches: tuple[int, ...] = (1, 4, 16, 32)
    contexts: tuple[int, ...] = (64, 1024)
    decode_steps: int = 5
    repeats: int = 2

    def __post_init__(self) -> None:
        for name in ("prompts", "prompt_counts", "batches", "contexts"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive numbers, got {values!r}")
        if self.decode_steps < 1 or self.repeats < 1:
            raise ValueError("decode_steps and repeats must be at least 1")


class _Bench:
    """Runs requests through one engine and times its steps."""

    def __init__(self, engine, vocab_size: int) -> None:
        self.engine, self.vocab = engine, vocab_size
        self._ids = itertools.count()

    def add(self, tokens: int, max_tokens: int) -> str:
        from tandem.engine.sampling_params import SamplingParams

        seed = next(self._ids)
        prompt = [100 + (seed * 7919 + i * 37) % (self.vocab - 100) for i in range(tokens)]
        request_id = f"profile-{seed}"
        self.engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                   ignore_eos=True))
        return request_id

    def drain(self) -> tuple[float, int]:
        """Steps until nothing is left: (seconds, steps)."""
        start, steps = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            self.engine.step()
            steps += 1
        return time.perf_counter() - start, steps

    def prefill(self, prompt_tokens: int, prompts: int) -> PrefillPoint:
        for _ in range(prompts):
            self.add(prompt_tokens, 1)  # done at its first token
        seconds, steps = self.drain()
        return PrefillPoint(prompt_tokens=prompt_tokens, prompts=prompts, steps=steps, seconds=seconds)

    def decode(self, batch: int, context: int, decode_steps: int, max_tokens: int) -> DecodePoint:
        """batch sequences of `context` prompt tokens, each prefilled (those prefilled first decode meanwhile: at
        most max_tokens - decode_steps tokens), then decode_steps timed steps of all of them; aborted after."""
        generated = {self.add(context, max_tokens): 0 for _ in range(batch)}
        while not all(generated.values()):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"profile: {batch} sequences of {context} tokens ended before decoding")
            for out in self.engine.step():
                generated[out.request_id] += len(out.token_ids)
        reached = context + statistics.fmean(generated.values())
        times = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            outputs = self.engine.step()
            times.append(time.perf_counter() - start)
            if len(outputs) != batch:
                raise RuntimeError(f"profile: a decode step of {batch} sequences produced {len(outputs)} outputs")
        for request_id in generated:
            self.engine.abort_request(request_id)
        self.drain()
        return DecodePoint(batch=batch, context=round(reached + decode_steps / 2), seconds=statistics.median(times))


def _profiled_spec(manifest: Manifest, pool):
    spec = replica_spec(manifest, pool)
    e = spec.engine
    engine = dataclasses.replace(e, enable_prefix_caching=False, speculative=None, kv_tiers=None,
                                 compile=True if e.compile == "background" else e.compile)
    return dataclasses.replace(spec, engine=engine)


def profile_pool(manifest: Manifest, name: str, grid: Grid, say: Callable[[str], None]) -> PoolProfile:
    """Builds one replica of pool `name` in this process and measures the grid on it (see the module docstring).
    Raises ValueError when fewer points fit than the fits need."""
    pool = getattr(manifest.pools, name)
    spec = _profiled_spec(manifest, pool)
    say(f"profile: building a {name} replica ({spec.parallel.tp}x{spec.parallel.pp}x{spec.parallel.ep} tp x pp x "
        f"ep, {spec.threads} thread(s))")
    engine = spec.build()
    try:
        config = engine.config
        limit, blocks, block = engine.max_model_len, engine.executor.num_kv_blocks, config.block_size
        bench = _Bench(engine, engine.vocab_size)
        bench.add(64, 2)  # warm-up: the first step pays for the kernels' start
        bench.drain()

        def fits(count: int, tokens: int) -> bool:
            return tokens <= limit and count * math.ceil(tokens / block) <= blocks and count <= config.max_num_seqs

        prefill, decode = [], []
        for tokens, count in itertools.product(grid.prompts, grid.prompt_counts):
            if not fits(count, tokens + 1):
                say(f"profile: {name}: {count} prompt(s) of {tokens} tokens do not fit the pool; left out")
                continue
            best = min((bench.prefill(tokens, count) for _ in range(grid.repeats)), key=lambda p: p.seconds)
            prefill.append(best)
            say(f"profile: {name}: prefill {count} x {tokens} tokens: {best.seconds * 1e3:.1f} ms in {best.steps} "
                f"step(s)")
        for context, batch in itertools.product(grid.contexts, grid.batches):
            # Enough output tokens for those prefilled first to decode while the others prefill, and the timed steps.
            max_tokens = math.ceil(batch * context / config.max_num_batched_tokens) + grid.decode_steps + 2
            if not fits(batch, context + max_tokens):
                say(f"profile: {name}: decode of {batch} x {context} tokens does not fit the pool; left out")
                continue
            point = bench.decode(batch, context, grid.decode_steps, max_tokens)
            decode.append(point)
            say(f"profile: {name}: decode step of {batch} sequences at {context} tokens: "
                f"{point.seconds * 1e3:.2f} ms")
        fit = fit_points(prefill, decode, config.max_num_batched_tokens)
        say(f"profile: {name}: step {fit.step_s * 1e3:.2f} ms + {fit.decode_token_s * 1e3:.3f} ms a sequence + "
            f"{fit.context_token_s * 1e6:.3f} us a context token; prefill {fit.prefill_token_s * 1e6:.1f} us a token "
            f"+ {fit.prefill_pair_s * 1e9:.3f} ns a token pair (errors: decode {fit.decode_error:.1%}, prefill "
            f"{fit.prefill_error:.1%})")
        spec_kv, first = engine.kv_cache_spec, engine.rank_placements[0]
        return PoolProfile(
            layout=Layout(tp=spec.parallel.tp, pp=spec.parallel.pp, ep=spec.parallel.ep, device=first.device,
                          dtype=str(engine.loaded.dtype).removeprefix("torch."), weights=spec.weights,
                          threads=spec.threads, compiled=not first.decode_step.startswith("eager")),
            block_size=block, num_kv_blocks=blocks, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, kv_bytes_per_token=spec_kv.bytes_per_block // block,
            prefill=tuple(prefill), decode=tuple(decode), fit=fit)
    finally:
        engine.shutdown()


def machine_description() -> str:
    """The CPU's model, its kernel-relevant flags and cores (and the GPU when torch sees one)."""
    import os

    import torch

    from tandem.engine.hardware.cpu_features import cpu_features, cpu_model

    cpu = f"{cpu_model()} ({' '.join(cpu_features().flags) or platform.machine()}), {os.cpu_count()} cores"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; host {cpu}"
    return cpu


def measure_transfer(manifest: Manifest, say: Callable[[str], None]) -> Transfer:
    """The KV transfer rate of a disaggregated manifest on this host (the module docstring). Raises RuntimeError
    naming what failed."""
    import torch

    from tandem.engine.kv.kv_cache import kv_dtype_name, kv_storage_dtype
    from tandem.engine.loader import load_model
    from tandem.kv_transfer.descriptor import KVFormat

    prefill, decode = manifest.pools.prefill, manifest.pools.decode
    model = load_model(manifest.model_path, weights=False, progress=False).config
    # Transfers carry the prefill pool's KV dtype (a decode pool storing another converts on receipt).
    dtype = kv_dtype_name(kv_storage_dtype(prefill.engine.kv_cache_dtype, getattr(torch, prefill.dtype)))
    kv = KVFormat(model.num_layers, model.num_kv_heads, model.head_dim, decode.engine.block_size, dtype)
    config = transfer_config(manifest, secrets.token_bytes(32))
    config = config if config.host else config.on_host("127.0.0.1")
    say(f"profile: measuring the KV transfer rate: {PROBE_REQUESTS} requests x {PROBE_TOKENS} tokens of {dtype} KV "
        f"({kv.bytes_per_token / 1024:.1f} KiB a token) between two processes on this host, shared memory "
        f"{'on' if config.shared_memory else 'off'}")
    start = time.perf_counter()
    try:
        rate = measure_transfer_rate(kv, config, tokens=PROBE_TOKENS, requests=PROBE_REQUESTS, rounds=PROBE_ROUNDS,
                                     device=decode.device, sender_cpus=prefill.cpu_affinity,
                                     receiver_cpus=decode.cpu_affinity)
    except RuntimeError as e:
        raise RuntimeError(f"{e} (or give the rate: --transfer-bytes-per-s)") from None
    say(f"profile: KV transfer: {rate.describe()} (measured in {time.perf_counter() - start:.1f} s)")
    return Transfer(bytes_per_s=rate.bytes_per_s,
                    source=f"measured: the {rate.path} path, median of {rate.rounds} rounds of {rate.requests} "
                           f"requests x {rate.tokens} tokens between two processes on this host with the manifest's "
                           f"transport settings (between hosts the network sets the rate)")


def profile_manifest(manifest: Manifest, source: str, grid: Grid, *, pools: Sequence[str] | None = None,
                     transfer_bytes_per_s: float | None = None,
                     say: Callable[[str], None] = lambda line: None) -> Profile:
    """Profiles `pools` (default: every pool of the manifest) one after the other, and the KV transfer rate
    (transfer_bytes_per_s: given instead; say: progress lines). Raises ValueError for an unknown pool,
    RuntimeError when the transfer cannot be measured."""
    names = list(pools) if pools else [name for name, _ in manifest.pool_items()]
    unknown = [n for n in names if getattr(manifest.pools, n, None) is None]
    if unknown:
        raise ValueError(f"the manifest has no pool {unknown[0]!r}; it has "
                         f"{', '.join(n for n, _ in manifest.pool_items())}")
    if transfer_bytes_per_s:
        transfer = Transfer(bytes_per_s=transfer_bytes_per_s, source="given (--transfer-bytes-per-s)")
    elif manifest.mode == "colocated":
        transfer = Transfer(bytes_per_s=UCX_LOOPBACK_BYTES_PER_S,
                            source="assumed: UCX over tcp/lo on one host (DESIGN.md section 4); not measured, and "
                                   "not used: colocated serving moves no KV between replicas")
    else:  # first: before the pools' replicas pin this process to their CPUs
        transfer = measure_transfer(manifest, say)
    profiled = {name: profile_pool(manifest, name, grid, say) for name in names}
    return Profile(machine=machine_description(), model=manifest.model, manifest=source, mode=manifest.mode,
                   manifest_yaml=Path(source).read_text(),
                   created=datetime.now(timezone.utc).isoformat(timespec="seconds"), pools=profiled,
                   transfer=transfer)
