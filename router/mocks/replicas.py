"""Mock replicas (STYLE.md's mock engine): deterministic tokens, a configurable step latency and a prefix cache
that hashes and publishes KV events exactly as the engine's does, behind the same Protocols the real replicas
answer (replica/contract.py's PrefillReplicaAPI and DecodeReplicaAPI). The router's request driver and routing
run their real code paths (route, reserve, prefill, decode, fallback, migration, abort, KV feed) over them in
milliseconds without Ray or a model: the router tests and bench/routing.py use them. DyingDecode and DyingPrefill
die as Ray reports a dead actor, for the failure paths.

A prefill replica computes one prompt at a time, taking step_s + per_token_s per uncached prompt token: the
cost model bench/routing.py measures routing policies against."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import OrderedDict
from typing import AsyncIterator, Sequence

from tandem.engine.core.output_processor import RequestOutput, TokenLogprob
from tandem.engine.core.resume import ResumeState
from tandem.engine.kv.kv_events import BlockRemoved, BlockStored, KVEventLog, KVSnapshot
from tandem.engine.kv.prefix_cache import block_hashes
from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import KVFormat, TransferDescriptor, TransferFailedError, TransferState
from tandem.kv_transfer.drops import MessageDrops
from tandem.replica.contract import KVEventsReply, PrefillResult, ReplicaInfo, ReplicaStats

BLOCK_SIZE = 16
# What a mock decode replica's descriptors describe: one rank holding a one-layer model.
_LAYOUT = ReplicaLayout.build(ParallelConfig(), num_layers=1, num_heads=1, num_kv_heads=1)
_KV = KVFormat(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BLOCK_SIZE, dtype="float32")
LEASE_S = 30.0


class MockKVCache:
    """One replica's prefix cache: LRU over capacity blocks of block_size tokens, hashed with the engine's
    block_hashes (cache salt included) and published through a real KVEventLog. lose_events: the fraction of
    events silently dropped (never numbered: the router cannot notice, only its hit rate suffers)."""

    def __init__(self, capacity: int = 4096, block_size: int = 16, *, lose_events: float = 0.0, seed: int = 0):
        self.capacity, self.block_size, self.lose_events = capacity, block_size, lose_events
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.log = KVEventLog()
        self.rng = random.Random(seed)
        self.skip_next = False  # the next kv_events answer goes missing (the router must notice the gap)

    def _publish(self, event) -> None:
        if not (self.lose_events and self.rng.random() < self.lose_events):
            self.log(event)

    def lookup(self, prompt, cache_salt=None) -> tuple[list[int], int]:
        """The prompt's block hashes and how many leading ones are cached."""
        hashes = block_hashes(prompt, self.block_size, cache_salt)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            self.blocks.move_to_end(hashes[hit])
            hit += 1
        return hashes, hit

    def store(self, prompt, cache_salt=None) -> int:
        """Caches every full block of prompt; returns the prompt tokens that were cached before."""
        hashes, hit = self.lookup(prompt, cache_salt)
        for i in range(hit, len(hashes)):
            self.blocks[hashes[i]] = None
            self._publish(BlockStored(hashes[i], hashes[i - 1] if i else None,
                                      tuple(prompt[i * self.block_size:(i + 1) * self.block_size]), cache_salt))
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            self._publish(BlockRemoved(tuple(evicted)))
        return hit * self.block_size

    def kv_events(self, epoch, since, kv_blocks_free: int) -> KVEventsReply:
        batch = self.log.read(epoch, since)
        if batch is None:
            batch = KVSnapshot(self.log.epoch, self.log.next_seq, tuple(self.blocks))
        elif self.skip_next and batch.events:
            self.skip_next = False
            batch = type(batch)(batch.epoch, batch.first_seq + 1, batch.events[1:])
        return KVEventsReply(batch, kv_blocks_free)


def token_for(prompt: tuple[int, ...], i: int) -> int:
    """The mock model: token i of a completion depends only on the prompt."""
    return (sum(prompt) * 31 + i * 7) % 1000


def _output(request_id, prompt, tokens, i0, finished, cached=0, index=0, logprobs=None) -> RequestOutput:
    """logprobs: k alternatives per token (None: no logprobs); the mock's log-probability of token t is -t/1000."""
    lps = None if logprobs is None else tuple(
        TokenLogprob(t, -t / 1000, tuple((t + j, -(t + j) / 1000) for j in range(1, logprobs + 1))) for t in tokens)
    return RequestOutput(request_id, index, tuple(tokens), "".join(f"<{t}>" for t in tokens), lps,
                         "length" if finished else None, len(prompt), cached, finished)


class _MockReplica:
    """What both mock roles answer besides their own calls (ReplicaAPI)."""

    pool = ""

    def __init__(self, name: str, blocks: int, lose_events: float):
        self.name = name
        self.cache = MockKVCache(blocks, BLOCK_SIZE, lose_events=lose_events)
        self.aborted: list[str] = []
        self.running = 0
        self.kv_messages_dropped = MessageDrops()  # what stats() reports its KV agents dropped (settable)
        self.kv_messages_by_reference = 0  # and sent by reference (settable)
        self.kv_bytes_sent = self.kv_bytes_received = 0  # and KV payload bytes moved (settable)
        self.num_preemptions = 0  # what stats() reports its scheduler preempted (settable)
        self.traces: list[str | None] = []  # the traceparent each serving call carried (None: not traced)
        self.speculation = None  # what stats() reports its speculative decoding did (settable: SpeculationStats)
        self.pulls_in: dict[str, tuple[tuple[int, ...], str | None]] = {}  # prefix pulls reserved here
        self.pulls_out: list[str] = []  # prefix pulls sent from here
        self.lora_adapters: dict[str, str] = {}  # LoRA adapters loaded here: name -> path

    async def ready(self) -> ReplicaInfo:
        return ReplicaInfo(name=self.name, pool=self.pool, pid=os.getpid(), node="127.0.0.1", node_id=None,
                           layout=tuple(_LAYOUT.describe()), world_size=1, max_model_len=8192,
                           block_size=BLOCK_SIZE, kv_blocks_total=self.cache.capacity,
                           kv_addresses=(f"mock://{self.name}",), lora_adapters=tuple(self.lora_adapters))

    async def load_lora(self, name: str, path: str) -> float:
        if not name or not path:
            raise ValueError("a LoRA adapter needs a name and a path")
        self.lora_adapters[name] = path
        return 0.0

    async def unload_lora(self, name: str) -> None:
        if self.lora_adapters.pop(name, None) is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")

    def _blocks_in_use(self) -> int:
        return 0

    async def stats(self) -> ReplicaStats:
        in_use = self._blocks_in_use()
        return ReplicaStats(name=self.name, pool=self.pool, state="ready", running=self.running, waiting=0,
                            waiting_for_kv=0, kv_blocks_total=self.cache.capacity, kv_blocks_in_use=in_use,
                            kv_blocks_cached=len(self.cache.blocks), kv_usage=in_use / self.cache.capacity,
                            prefix_hit_rate=0.0, num_preemptions=self.num_preemptions, num_steps=0,
                            kv_messages_dropped=self.kv_messages_dropped,
                            kv_messages_by_reference=self.kv_messages_by_reference,
                            kv_bytes_sent=self.kv_bytes_sent, kv_bytes_received=self.kv_bytes_received,
                            speculation=self.speculation)

    async def health(self) -> str | None:
        return "it died" if getattr(self, "dead", False) else None

    async def kv_events(self, epoch: str | None, since: int) -> KVEventsReply:
        return self.cache.kv_events(epoch, since, self.cache.capacity - self._blocks_in_use())

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.pulls_in.pop(request_id, None)

    async def reserve_prefix(self, pull_id: str, prefix_token_ids: Sequence[int], *, cache_salt: str | None = None,
                             senders: tuple[str, ...] = ()) -> TransferDescriptor | None:
        prefix = tuple(prefix_token_ids)
        self.pulls_in[pull_id] = (prefix, cache_salt)
        _, own = self.cache.lookup(prefix, cache_salt)
        missing = len(prefix) // BLOCK_SIZE - min(own, len(prefix) // BLOCK_SIZE - 1)  # what the holder sends
        return TransferDescriptor(f"{pull_id}/0", _LAYOUT, ("mock://" + self.name,), tuple(range(missing)),
                                  missing * BLOCK_SIZE, _KV, time.time() + LEASE_S)

    async def send_prefix(self, pull_id: str, block_hashes: tuple[int, ...], descriptor: TransferDescriptor, *,
                          prefix_token_ids: tuple[int, ...] = (), cache_salt: str | None = None) -> None:
        if missing := [h for h in block_hashes if h not in self.cache.blocks]:
            raise LookupError(f"{self.name} no longer caches {len(missing)} of the prefix's blocks")
        self.pulls_out.append(pull_id)

    async def keep_prefix(self, pull_id: str) -> int:
        prefix, salt = self.pulls_in.pop(pull_id)
        self.cache.store(prefix, salt)  # what the holder sent enters this replica's prefix cache
        return len(prefix) // BLOCK_SIZE

    async def check_integrity(self) -> None:
        if self.running < 0:
            raise ValueError(f"{self.name}: {self.running} requests running")

    async def shutdown(self) -> None:
        pass


class MockDecode(_MockReplica):
    """DecodeReplicaAPI."""

    pool = "decode"

    def __init__(self, name: str, *, room: list[bool] | None = None, step_s: float = 0.0, blocks: int = 4096,
                 per_token_s: float = 0.0, lose_events: float = 0.0):
        """room: reserve() answers from this list in turn (True: a descriptor, False: no room), then True.
        per_token_s: what generate() spends per uncached prompt token before its first output."""
        super().__init__(name, blocks, lose_events)
        self.room, self.step_s, self.per_token_s = list(room or []), step_s, per_token_s
        self.reservations: dict[str, tuple] = {}
        self.served: list[str] = []  # request ids admitted here (reserved or generated)
        self.salts: list[str | None] = []
        self.senders: list[tuple[str, ...]] = []  # what each reserve() named as the prefill replica's agents
        self.resumed: list[tuple[str, ResumeState]] = []  # what each resume() was asked to continue

    def _blocks_in_use(self) -> int:
        """4 blocks per running request, plus what reservations hold (one block per 16 prompt tokens)."""
        reserved = sum(-(-len(prompt) // BLOCK_SIZE) for prompt, _, _ in self.reservations.values())
        return min(self.cache.capacity, self.running * 4 + reserved)

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None, senders: tuple[str, ...] = (),
                      tenant: str | None = None, waited_s: float = 0.0) -> TransferDescriptor | None:
        prompt = tuple(prompt_token_ids)
        if self.room and not self.room.pop(0):
            return None
        self.reservations[request_id] = (tuple(prompt), params, cache_salt)
        self.served.append(request_id)
        self.salts.append(cache_salt)
        self.senders.append(tuple(senders))
        blocks = tuple(range(-(-len(prompt) // BLOCK_SIZE)))
        return TransferDescriptor(f"{request_id}/0", _LAYOUT, ("mock://" + self.name,), blocks, len(prompt), _KV,
                                  time.time() + LEASE_S)

    async def decode(self, request_id: str, first_token: SampledToken, *,
                     trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        self.traces.append(trace)
        first = first_token
        prompt, params, salt = self.reservations.pop(request_id)
        self.cache.store(prompt, salt)  # the transferred blocks enter this replica's prefix cache
        tokens = [first.token_id] + [token_for(prompt, i) for i in range(1, params.max_tokens)]
        async for batch in self._stream(request_id, prompt, tokens, logprobs=params.logprobs):
            yield batch

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                       trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        self.traces.append(trace)
        prompt = tuple(prompt_token_ids)
        self.served.append(request_id)
        self.salts.append(cache_salt)
        cached = self.cache.store(tuple(prompt), cache_salt)
        await asyncio.sleep(self.per_token_s * (len(prompt) - cached))
        tokens = [token_for(tuple(prompt), i) for i in range(params.max_tokens)]
        async for batch in self._stream(request_id, tuple(prompt), tokens, cached, n=params.n,
                                        logprobs=params.logprobs):
            yield batch

    async def resume(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     resume: ResumeState, *, priority: int = 0, cache_salt: str | None = None,
                     tenant: str | None = None, trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """The mock model's completion from token len(resume.output_token_ids) on (it depends only on the
        prompt, so it continues any replica's). Raises ValueError as the engine does for what cannot resume."""
        self.traces.append(trace)
        prompt = tuple(prompt_token_ids)
        delivered = len(resume.output_token_ids)
        if params.n != 1 or delivered >= params.max_tokens:
            raise ValueError(f"cannot resume n={params.n} with {delivered} of {params.max_tokens} tokens delivered")
        self.served.append(request_id)
        self.salts.append(cache_salt)
        self.resumed.append((request_id, resume))
        cached = self.cache.store(prompt, cache_salt)
        await asyncio.sleep(self.per_token_s * (len(prompt) + delivered - cached))
        tokens = [token_for(prompt, i) for i in range(delivered, params.max_tokens)]
        async for batch in self._stream(request_id, prompt, tokens, cached, logprobs=params.logprobs):
            yield batch

    async def _stream(self, request_id, prompt, tokens, cached=0, n=1, logprobs=None):
        """Sample k of n is the completion shifted by k (token + k), so samples differ."""
        self.running += 1
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.step_s)
                last = i == len(tokens) - 1
                yield [_output(request_id, prompt, [token + k], i, last, cached, k, logprobs) for k in range(n)]
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.reservations.pop(request_id, None)


class MockPrefill(_MockReplica):
    """PrefillReplicaAPI."""

    pool = "prefill"

    def __init__(self, name: str, *, fail: TransferState | None = None, step_s: float = 0.0,
                 per_token_s: float = 0.0, blocks: int = 4096, lose_events: float = 0.0):
        super().__init__(name, blocks, lose_events)
        self.fail, self.step_s, self.per_token_s = fail, step_s, per_token_s
        self.prefilled: list[str] = []
        self.cached_tokens: dict[str, int] = {}  # request id -> prompt tokens its prefill found cached
        self._compute = asyncio.Lock()  # one prompt at a time, like one accelerator

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0, cache_salt: str | None = None,
                      tenant: str | None = None, trace: str | None = None) -> PrefillResult:
        self.traces.append(trace)
        prompt = tuple(prompt_token_ids)
        called = time.monotonic()
        async with self._compute:
            queue_s = time.monotonic() - called  # waiting for the prompts before it
            _, hit = self.cache.lookup(tuple(prompt), cache_salt)
            await asyncio.sleep(self.step_s + self.per_token_s * (len(prompt) - hit * self.cache.block_size))
            cached = self.cache.store(tuple(prompt), cache_salt)
        self.prefilled.append(request_id)
        self.cached_tokens[request_id] = cached
        if self.fail is not None:
            raise TransferFailedError(request_id, self.fail, "the peer went away")
        return PrefillResult(SampledToken(token_for(tuple(prompt), 0), None, ()), len(prompt), cached,
                             queue_s=queue_s)


class DyingDecode(MockDecode):
    """Dies (as Ray reports a dead actor) after streaming `after` outputs of a request (any stream: decode,
    generate or resume); after < 0: already dead at reserve(). Once dead it holds nothing (a dead actor's
    blocks went with it)."""

    def __init__(self, name: str, after: int, *, step_s: float = 0.0):
        super().__init__(name, step_s=step_s)
        self.after = after
        self.dead = False

    async def _stream(self, request_id, prompt, tokens, *args, **kwargs):
        from ray.exceptions import RayActorError

        async for i, batch in _enumerate(super()._stream(request_id, prompt, tokens, *args, **kwargs)):
            if i == self.after:
                self.dead = True
                self.reservations.clear()
                raise RayActorError()
            yield batch

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None, senders: tuple[str, ...] = (),
                      tenant: str | None = None, waited_s: float = 0.0) -> TransferDescriptor | None:
        prompt = tuple(prompt_token_ids)
        if self.after < 0:
            from ray.exceptions import RayActorError

            raise RayActorError()
        return await super().reserve(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                     senders=senders)


async def _enumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1


class DyingPrefill(MockPrefill):
    """Dies (as Ray reports a dead actor) while computing a prompt: prefill() raises RayActorError, after
    step_s, having pushed nothing to the decode replica's reservation."""

    def __init__(self, name: str, *, step_s: float = 0.0):
        super().__init__(name, step_s=step_s)
        self.dead = False

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0, cache_salt: str | None = None,
                      tenant: str | None = None, trace: str | None = None) -> PrefillResult:
        self.traces.append(trace)
        from ray.exceptions import RayActorError

        await asyncio.sleep(self.step_s)
        self.dead = True
        raise RayActorError()
