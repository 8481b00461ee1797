"""Mock replicas that batch like the engine: each replica has ONE step loop (engine/core/scheduler.py's order), so a
colocated replica's prompt chunks share steps with its running decodes, and a long prompt stalls every decoding
sequence's next token. bench/disagg_scale.py compares disaggregated and colocated serving over them, through the
router's real request driver; tokens, prefix cache, KV events and abort are router/mocks/replicas.py's.

Cost model (StepCosts, seconds). A step:
  1. every running decoding sequence gets one token;
  2. running sequences still prefilling, then waiting ones (admitted while the replica runs fewer than
     max_num_seqs), get prompt chunks from what max_num_batched_tokens leaves, first come first served;
  3. lasts step_s + decode_token_s * decodes + context_token_s * the decodes' context tokens
     + prefill_token_s * prompt tokens computed + prefill_pair_s * the (token, earlier token) pairs that the
     chunks' attention computes (a chunk of n tokens after o computed or cached ones: n * o + n * (n + 1) / 2);
  4. at its end every decode emits its token, and a prompt whose last chunk ran emits its first token
     (BatchedDecode.generate) or answers prefill() (BatchedPrefill).
A transferred request (BatchedDecode.reserve + decode) joins the decode batch kv_bytes_per_token * prompt tokens
/ transfer_bytes_per_s after decode() is called (the transfer does not occupy the step loop), emitting the first
token it carries at once. A resumed request (BatchedDecode.resume, a migration) is admitted like a generated one,
its delivered tokens computed with its prompt, and emits from the token after them. Steps follow each other on
the loop's own clock: a step that ended late because the event loop was busy is made up by shorter sleeps (up to
StepCosts.catch_up_s behind), so a replica's throughput stays the model's while many replicas share one process
(or one process with a busy router, which a real replica's does not). Prompt tokens found in the replica's prefix
cache when it is admitted are not computed (at least one token always is). KV capacity (beyond max_num_seqs) and
preemption are not modelled. cluster/hardware_profile.py's Profile.step_costs gives a profiled pool's costs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferFailedError, TransferState
from tandem.replica.contract import PrefillResult, ReplicaStats, RequestAbortedError
from tandem.router.mocks.replicas import _KV, _LAYOUT, BLOCK_SIZE, LEASE_S, _MockReplica, _output, token_for


@dataclass(frozen=True)
class StepCosts:
    """What one engine step costs (seconds) and what it may hold. kv_bytes_per_token: one token's KV over every
    layer (K and V); transfer_bytes_per_s: the KV transport's rate between a prefill and a decode replica.
    context_token_s / prefill_pair_s: attention's share, per context token of a decoding sequence and per
    (token, earlier token) pair of a prompt chunk (0: a step's cost does not depend on context).
    catch_up_s: how far behind its own clock the step loop may fall and still make the time up with shorter
    sleeps (time the event loop was held beyond it is lost to the replica, as a stall)."""

    step_s: float = 0.0
    decode_token_s: float = 0.0
    prefill_token_s: float = 0.0
    context_token_s: float = 0.0
    prefill_pair_s: float = 0.0
    kv_bytes_per_token: int = 0
    transfer_bytes_per_s: float = 1.7e9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    catch_up_s: float = 0.05

    def __post_init__(self) -> None:
        for name, low in (("step_s", 0), ("decode_token_s", 0), ("prefill_token_s", 0), ("context_token_s", 0),
                          ("prefill_pair_s", 0), ("kv_bytes_per_token", 0),
                          ("transfer_bytes_per_s", 1), ("max_num_batched_tokens", 1), ("max_num_seqs", 1),
                          ("catch_up_s", 0)):
            if not getattr(self, name) >= low:
                raise ValueError(f"StepCosts.{name} must be at least {low:g}, got {getattr(self, name)!r}")

    def step_time(self, decodes: int, prefill_tokens: int, context_tokens: int = 0,
                  prefill_pairs: float = 0.0) -> float:
        """Seconds of a step with `decodes` decoding sequences (context_tokens in all) and `prefill_tokens`
        prompt tokens computed (prefill_pairs: their attention's pairs, the module docstring's item 3)."""
        return (self.step_s + self.decode_token_s * decodes + self.context_token_s * context_tokens
                + self.prefill_token_s * prefill_tokens + self.prefill_pair_s * prefill_pairs)

    def transfer_time(self, prompt_tokens: int) -> float:
        """Seconds to move a prompt's KV from a prefill to a decode replica."""
        return self.kv_bytes_per_token * prompt_tokens / self.transfer_bytes_per_s


@dataclass(eq=False)
class _Seq:
    """One request in a step loop. to_prefill: prompt tokens still to compute (0: decoding). outputs: where a
    decoding request's token batches go (an exception ends its stream); done: a prefill's answer."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    salt: str | None
    to_prefill: int = 0
    cached: int = 0
    emitted: int = 0
    first_token: int | None = None
    outputs: asyncio.Queue | None = None
    done: asyncio.Future | None = None

    def emit(self) -> bool:
        """Puts this step's token (one per sample) on outputs; returns whether it was the last."""
        i = self.emitted
        token = self.first_token if i == 0 and self.first_token is not None else token_for(self.prompt, i)
        last = i + 1 >= self.params.max_tokens
        self.outputs.put_nowait([_output(self.request_id, self.prompt, [token + k], i, last, self.cached, k,
                                         self.params.logprobs) for k in range(self.params.n)])
        self.emitted += 1
        return last

    def fail(self, error: Exception) -> None:
        if self.outputs is not None:
            self.outputs.put_nowait(error)
        if self.done is not None and not self.done.done():
            self.done.set_exception(error)

    def context(self) -> int:
        """Tokens this sequence attends to in its next decode step."""
        return len(self.prompt) + self.emitted

    def pairs(self, n: int) -> float:
        """Attention pairs of its next prompt chunk of n tokens (after those already computed or cached)."""
        before = self.context() - self.to_prefill
        return n * before + n * (n + 1) / 2

    def blocks(self) -> int:
        return -(-(len(self.prompt) + self.emitted) // BLOCK_SIZE)


class StepLoop:
    """One replica's scheduler and model runner in one: steps while it holds requests, sleeps on an event when
    it holds none. admitted(seq) runs as a waiting request is first scheduled (it sets to_prefill and cached);
    prefilled(seq) when its last chunk ran, and answers whether it goes on decoding here."""

    def __init__(self, costs: StepCosts, admitted: Callable[[_Seq], None], prefilled: Callable[[_Seq], bool]):
        self.costs, self.admitted, self.prefilled = costs, admitted, prefilled
        self.running: dict[str, _Seq] = {}  # in order of admission
        self.waiting: dict[str, _Seq] = {}  # in order of arrival
        self.num_steps = 0
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    def add(self, seq: _Seq, *, running: bool = False) -> None:
        """Queues seq for admission, or (running: a transferred request, already admitted) adds it to the batch.
        Must be called on the event loop."""
        (self.running if running else self.waiting)[seq.request_id] = seq
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    def remove(self, request_id: str) -> _Seq | None:
        """Takes the request out of the loop (it holds nothing any more); None if it was not here."""
        return self.running.pop(request_id, None) or self.waiting.pop(request_id, None)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def schedule(self) -> tuple[list[_Seq], list[tuple[_Seq, int]]]:
        """This step's decoding sequences and (sequence, prompt tokens) chunks; admits waiting requests."""
        c = self.costs
        decodes = [s for s in self.running.values() if not s.to_prefill][:c.max_num_batched_tokens]
        budget = c.max_num_batched_tokens - len(decodes)
        chunks = []
        for seq in self.running.values():
            if budget and seq.to_prefill:
                chunks.append((seq, min(seq.to_prefill, budget)))
                budget -= chunks[-1][1]
        while budget and self.waiting and len(self.running) < c.max_num_seqs:
            seq = self.waiting.pop(next(iter(self.waiting)))
            self.admitted(seq)
            self.running[seq.request_id] = seq
            chunks.append((seq, min(seq.to_prefill, budget)))
            budget -= chunks[-1][1]
        return decodes, chunks

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time()
        while True:
            decodes, chunks = self.schedule()
            if not decodes and not chunks:
                self._wake.clear()
                await self._wake.wait()
                end = loop.time()
                continue
            end = max(end, loop.time() - self.costs.catch_up_s) + self.costs.step_time(
                len(decodes), sum(n for _, n in chunks), sum(s.context() for s in decodes),
                sum(s.pairs(n) for s, n in chunks))
            await asyncio.sleep(max(0.0, end - loop.time()))
            self.num_steps += 1
            for seq in decodes:
                if self.running.get(seq.request_id) is seq and seq.emit():
                    del self.running[seq.request_id]
            for seq, n in chunks:
                if self.running.get(seq.request_id) is seq:
                    seq.to_prefill -= n
                    if not seq.to_prefill and not self.prefilled(seq):
                        del self.running[seq.request_id]


class _BatchedReplica(_MockReplica):
    """What both batched roles share: the step loop, prefix-cache lookups at admission, stats and abort. A role
    defines _prefilled(seq) -> bool (StepLoop's prefilled)."""

    def __init__(self, name: str, costs: StepCosts, blocks: int, lose_events: float):
        super().__init__(name, blocks, lose_events)
        self.costs = costs
        self.loop = StepLoop(costs, self._admitted, self._prefilled)
        self._refused: set[str] = set()  # aborted ids: a later call for one is refused

    def _admitted(self, seq: _Seq) -> None:
        _, hit = self.cache.lookup(seq.prompt, seq.salt)
        seq.cached = hit * self.cache.block_size
        seq.to_prefill = max(1, len(seq.prompt) + seq.emitted - seq.cached)  # a resumed request's tokens too

    def _check(self, request_id: str) -> None:
        if request_id in self._refused:
            raise RequestAbortedError(f"request {request_id!r} was aborted")

    def _held(self) -> list[_Seq]:
        """Requests holding KV here."""
        return list(self.loop.running.values())

    def _blocks_in_use(self) -> int:
        return min(self.cache.capacity, sum(s.blocks() for s in self._held()))

    async def stats(self) -> ReplicaStats:
        s = await super().stats()
        return ReplicaStats(**{**vars(s), "running": len(self.loop.running), "waiting": len(self.loop.waiting),
                               "waiting_for_kv": len(self._held()) - len(self.loop.running),
                               "num_steps": self.loop.num_steps})

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self._refused.add(request_id)
        if (seq := self.loop.remove(request_id)) is not None:
            seq.fail(RequestAbortedError(f"request {request_id!r} was aborted"))

    async def check_integrity(self) -> None:
        both = self.loop.running.keys() & self.loop.waiting.keys()
        if both or any(s.to_prefill < 0 for s in self.loop.running.values()):
            raise ValueError(f"{self.name}: step loop inconsistent (in both queues: {sorted(both)})")

    async def shutdown(self) -> None:
        self.loop.stop()


class BatchedDecode(_BatchedReplica):
    """DecodeReplicaAPI: colocated (generate: the prompt is prefilled in chunks in this replica's own steps) and
    disaggregated (reserve + decode: the transferred request joins the batch)."""

    pool = "decode"

    def __init__(self, name: str, costs: StepCosts, *, blocks: int = 16384, lose_events: float = 0.0):
        """blocks: the prefix cache's and the KV pool's size (what kv_events reports free)."""
        super().__init__(name, costs, blocks, lose_events)
        self.reservations: dict[str, _Seq] = {}  # reserved, decode() not called yet
        self.transferring: dict[str, _Seq] = {}  # decode() called, KV on its way
        self.served: list[str] = []  # request ids admitted here (reserved or generated)

    def _held(self) -> list[_Seq]:
        return [*self.loop.running.values(), *self.reservations.values(), *self.transferring.values()]

    def _prefilled(self, seq: _Seq) -> bool:
        self.cache.store(seq.prompt, seq.salt)
        return not seq.emit()

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None, senders: tuple[str, ...] = (),
                      tenant: str | None = None, waited_s: float = 0.0) -> TransferDescriptor | None:
        """None (no room) while max_num_seqs requests are held here, waiting, reserved or running."""
        self._check(request_id)
        if len(self._held()) + len(self.loop.waiting) >= self.costs.max_num_seqs:
            return None
        prompt = tuple(prompt_token_ids)
        self.reservations[request_id] = _Seq(request_id, prompt, params, cache_salt)
        self.served.append(request_id)
        return TransferDescriptor(f"{request_id}/0", _LAYOUT, ("mock://" + self.name,),
                                  tuple(range(-(-len(prompt) // BLOCK_SIZE))), len(prompt), _KV,
                                  time.time() + LEASE_S)

    async def decode(self, request_id: str, first_token: SampledToken, *,
                     trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        self._check(request_id)
        seq = self.reservations.pop(request_id, None)
        if seq is None:
            raise ValueError(f"{self.name}: no reservation for request {request_id!r}")
        seq.first_token, seq.outputs = first_token.token_id, asyncio.Queue()
        self.transferring[request_id] = seq
        try:
            await asyncio.sleep(self.costs.transfer_time(len(seq.prompt)))
        finally:
            self.transferring.pop(request_id, None)
        self._check(request_id)  # aborted while its KV was on the way
        self.cache.store(seq.prompt, seq.salt)  # the transferred blocks enter this replica's prefix cache
        if not seq.emit():
            self.loop.add(seq, running=True)
        async for batch in self._stream(seq):
            yield batch

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                       trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        self._check(request_id)
        seq = _Seq(request_id, tuple(prompt_token_ids), params, cache_salt, outputs=asyncio.Queue())
        self.served.append(request_id)
        self.loop.add(seq)
        async for batch in self._stream(seq):
            yield batch

    async def resume(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     resume: ResumeState, *, priority: int = 0, cache_salt: str | None = None,
                     tenant: str | None = None, trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Like generate(), with the delivered tokens computed beside the prompt and the stream starting at the
        token after them (a migrated request)."""
        self._check(request_id)
        delivered = len(resume.output_token_ids)
        if params.n != 1 or delivered >= params.max_tokens:
            raise ValueError(f"cannot resume n={params.n} with {delivered} of {params.max_tokens} tokens delivered")
        seq = _Seq(request_id, tuple(prompt_token_ids), params, cache_salt, emitted=delivered,
                   outputs=asyncio.Queue())
        self.served.append(request_id)
        self.loop.add(seq)
        async for batch in self._stream(seq):
            yield batch

    async def _stream(self, seq: _Seq) -> AsyncIterator[list[RequestOutput]]:
        """Everything that arrived since the last item, as one list; a consumer that leaves frees the request."""
        try:
            while True:
                items = [await seq.outputs.get()]
                while not seq.outputs.empty():
                    items.append(seq.outputs.get_nowait())
                batch = []
                for item in items:
                    if isinstance(item, Exception):
                        raise item
                    batch += item
                yield batch
                if batch[-1].finished:
                    return
        finally:
            self.loop.remove(seq.request_id)

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.reservations.pop(request_id, None)


class BatchedPrefill(_BatchedReplica):
    """PrefillReplicaAPI: prompts are computed in chunks of several prompts per step, up to the token budget."""

    pool = "prefill"

    def __init__(self, name: str, costs: StepCosts, *, blocks: int = 4096, lose_events: float = 0.0,
                 fail: TransferState | None = None):
        """fail: every prefill ends in TransferFailedError with this state (after computing the prompt)."""
        super().__init__(name, costs, blocks, lose_events)
        self.fail = fail
        self.prefilled: list[str] = []
        self.cached_tokens: dict[str, int] = {}  # request id -> prompt tokens its prefill found cached

    def _prefilled(self, seq: _Seq) -> bool:
        self.cache.store(seq.prompt, seq.salt)
        if not seq.done.done():
            seq.done.set_result(None)
        return False

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0, cache_salt: str | None = None,
                      tenant: str | None = None, trace: str | None = None) -> PrefillResult:
        self._check(request_id)
        seq = _Seq(request_id, tuple(prompt_token_ids), params, cache_salt,
                   done=asyncio.get_running_loop().create_future())
        self.loop.add(seq)
        try:
            await seq.done
        finally:
            self.loop.remove(request_id)
        self.prefilled.append(request_id)
        self.cached_tokens[request_id] = seq.cached
        if self.fail is not None:
            raise TransferFailedError(request_id, self.fail, "the peer went away")
        return PrefillResult(SampledToken(token_for(seq.prompt, 0), None, ()), len(seq.prompt), seq.cached)
