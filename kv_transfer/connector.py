"""The per-request transfer state machines of a replica, on the decode and on the prefill side.

They live where the replica's scheduler lives (the engine's driver) and reach the replica's ranks' agents
through ReplicaAgents (replica_agents.py); nothing here blocks on the network, and poll() is meant to be called between
engine steps. One request, disaggregated:

  1. decode:  DecodeConnector.reserve() holds blocks for the prompt (engine.reserve_for_transfer), registers
              them with every decode rank's agent together with the prefill replica's agent addresses (the
              only peers the agents answer), and returns a TransferDescriptor (agent addresses and their shared-memory
              domains, block ids, KV
              format, lease deadline). State RESERVED. No room: None, nothing held.
  2. prefill: PrefillConnector.submit(descriptor) arms every prefill rank's agent and queues the prompt with
              max_tokens=1. As each layer of the prompt's last chunk is computed, the ranks push it to the
              decode ranks the plan names (kv_transfer/plan.py), re-sharding between the two layouts.
  3. both:    poll() folds the ranks' states into one per request: RESERVED -> TRANSFERRING -> DONE, or FAILED /
              EXPIRED / ABORTED as soon as any rank ends so. A request that ends badly is cleaned up inside
              poll(): every rank stops (no more writes), the decode side's blocks are freed (the request is
              aborted in its engine) and the agents forget the transfer. The event is reported once.
  4. prefill: the engine's step output carries the first token (a SampledToken).
  5. decode:  once DONE, admit(request_id, first_token) starts the request in the decode engine; it decodes
              from there exactly as a colocated run would.
  Either side may abort() at any time; the other side learns it from its agents (ABORTED). A lease that runs
  out (RESERVED, TRANSFERRING, or DONE and never admitted) ends in EXPIRED and frees the blocks by itself.

A prefix pulled from a replica that holds it (KV tiers across replicas, engine/core/kv_tiers.py) is the same
transfer with no request behind it: the puller's DecodeConnector.reserve_prefix() holds blocks for the prefix's
tokens (whole blocks; those it caches already are its own, the rest are the descriptor's), the holder's
PrefillConnector.send_prefix() holds its cached blocks of the descriptor's block hashes and sends them at once (same
wire format, MACs and re-sharding), and once DONE the puller's keep_prefix() puts the blocks in its prefix cache,
parked, for the request that comes next. Failures end as above; the holder's blocks are held until its side ends
(past it, for a receiver that reads them from a shared store).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.kv.kv_cache import kv_dtype_name
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat, RankStatus, TransferDescriptor, TransferState
from tandem.kv_transfer.replica_agents import ReplicaAgents


@dataclass(frozen=True)
class TransferEvent:
    """A request's transfer changed state (error says why for FAILED / EXPIRED / ABORTED)."""

    request_id: str
    state: TransferState
    error: str | None = None


def combine(statuses: Sequence[RankStatus | None]) -> tuple[TransferState, str | None]:
    """One state from the ranks' states (None: the rank does not know the transfer, i.e. it ended and was
    forgotten): the first rank that ended badly decides; DONE needs every rank; any movement is TRANSFERRING."""
    for rank, status in enumerate(statuses):
        if status is None:
            return TransferState.FAILED, f"rank {rank} no longer holds the transfer"
        if status.state.terminal and status.state is not TransferState.DONE:
            return status.state, f"rank {rank}: {status.error}"
    states = {s.state for s in statuses}
    if states == {TransferState.DONE}:
        return TransferState.DONE, None
    if states & {TransferState.TRANSFERRING, TransferState.DONE}:
        return TransferState.TRANSFERRING, None
    return TransferState.RESERVED, None


@dataclass
class _Entry:
    transfer_id: str
    deadline: float
    state: TransferState = TransferState.RESERVED


class _Connector:
    def __init__(self, engine: LLMEngine, clock: Callable[[], float]):
        self.engine = engine
        self.agents = ReplicaAgents(engine)
        self.addresses = self.agents.listen_addresses()  # this replica's agents, by rank
        self.shm_domains = self.agents.shared_memory_domains()
        self.clock = clock
        self.ranks = range(engine.layout.world_size)
        self._entries: dict[str, _Entry] = {}
        self._attempts = itertools.count()

    def state(self, request_id: str) -> TransferState | None:
        """The request's transfer state, None once it ended badly (reported by poll) or was admitted."""
        entry = self._entries.get(request_id)
        return entry.state if entry else None

    @property
    def num_pending(self) -> int:
        """Requests whose transfer has not ended (or, on the decode side, ended DONE and is not admitted yet)."""
        return len(self._entries)

    def poll(self) -> list[TransferEvent]:
        """State changes since the last poll. Cleans up transfers that ended badly (see the module docstring)."""
        if not self._entries:
            return []
        ids = [e.transfer_id for e in self._entries.values()]
        by_rank = self.agents.poll(ids)
        events, now = [], self.clock()
        for request_id, entry in list(self._entries.items()):
            state, error = combine([by_rank[r].get(entry.transfer_id) for r in self.ranks])
            # The lease covers a running transfer, and on the decode side a DONE one never admitted.
            if not state.terminal or (state is TransferState.DONE and not self._release_when_done):
                if now > entry.deadline:
                    state, error = TransferState.EXPIRED, f"the lease ran out with the transfer {state.value}"
                    self.agents.abort(entry.transfer_id, error, expired=True)
            if state is not entry.state:
                entry.state = state
                events.append(TransferEvent(request_id, state, error))
            if state.terminal and state is not TransferState.DONE:
                self._end(request_id, error or state.value)
            elif state is TransferState.DONE and self._release_when_done:
                entry = self._entries.pop(request_id)
                self.agents.release(entry.transfer_id)
                self._left(entry, done=True)
        return events

    _release_when_done = False

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Ends the request's transfer on every rank (ABORTED; the peer side learns it) and drops the request
        from this engine, freeing its blocks. No-op for an unknown request."""
        if request_id in self._entries:
            self.agents.abort(self._entries[request_id].transfer_id, reason)
            self._end(request_id, reason)

    def _end(self, request_id: str, reason: str) -> None:
        entry = self._entries.pop(request_id)
        self.agents.release(entry.transfer_id)  # aborts first where it still runs: no more writes after this
        self.engine.abort_request(request_id)
        self._left(entry, done=False)

    def _left(self, entry: _Entry, done: bool) -> None:
        """A transfer this side forgot: DONE (every destination acknowledged) or not."""

    def _new_transfer_id(self, request_id: str) -> str:
        return f"{request_id}/{next(self._attempts)}"


HOLD_GRACE_S = 5.0


class DecodeConnector(_Connector):
    def __init__(self, engine: LLMEngine, config: TransferConfig = TransferConfig(), *,
                 clock: Callable[[], float] = time.time):
        """engine must have been built with kv_agent=AgentFactory(...)."""
        super().__init__(engine, clock)
        self.config = config
        spec = engine.kv_cache_spec
        self.kv_format = KVFormat(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                                  kv_dtype_name(spec.dtype))

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                priority: int = 0, cache_salt: str | None = None, lease_s: float | None = None,
                senders: Sequence[str] = (), tenant: str | None = None,
                waited_s: float = 0.0) -> TransferDescriptor | None:
        """Holds blocks for the prompt and returns the descriptor the prefill side pushes into; None when the
        engine has no room now (nothing held). senders: the prefill replica's agent addresses by rank (its
        PrefillConnector.addresses), the only peers told how the transfer went (empty: nobody; they learn it
        from their leases). waited_s: how long it has waited for room (LLMEngine.reserve_for_transfer). Raises
        ValueError / RequestRejectedError for a request the engine cannot serve."""
        blocks = self.engine.reserve_for_transfer(request_id, prompt_token_ids, params, priority=priority,
                                                  cache_salt=cache_salt, tenant=tenant, waited_s=waited_s)
        if blocks is None:
            return None
        return self._expect(request_id, blocks, len(prompt_token_ids), lease_s, senders, params.lora)

    def _expect(self, request_id: str, blocks: tuple[int, ...], num_tokens: int, lease_s: float | None,
                senders: Sequence[str], lora: str | None = None) -> TransferDescriptor:
        """Registers held blocks with every rank's agent; the descriptor the sender pushes into."""
        transfer_id = self._new_transfer_id(request_id)
        deadline = self.clock() + (lease_s if lease_s is not None else self.config.lease_s)
        try:
            self.agents.expect(transfer_id, blocks, deadline, tuple(senders))
        except BaseException:
            self.agents.release(transfer_id)
            self.engine.abort_request(request_id)
            raise
        self._entries[request_id] = _Entry(transfer_id, deadline)
        return TransferDescriptor(transfer_id, self.engine.layout, self.addresses, blocks, num_tokens,
                                  self.kv_format, deadline, self.shm_domains, lora)

    def reserve_prefix(self, request_id: str, prefix_token_ids: Sequence[int], *, cache_salt: str | None = None,
                       senders: Sequence[str] = ()) -> TransferDescriptor | None:
        """A pull: holds blocks for a prefix of whole blocks (LLMEngine.reserve_prefix) and returns the
        descriptor the holder sends into: the prefix's blocks this replica does not cache yet, its last ones (the
        holder sends its blocks of the matching hashes: the last num_tokens // block_size of the prefix's). None
        when there is no room now."""
        blocks = self.engine.reserve_prefix(request_id, prefix_token_ids, cache_salt=cache_salt)
        if blocks is None:
            return None
        return self._expect(request_id, blocks, len(blocks) * self.engine.config.block_size, None, senders)

    def admit(self, request_id: str, first_token: SampledToken) -> list[RequestOutput]:
        """Starts a request whose KV has arrived (state DONE, as poll reported) with first_token, the prefill
        side's SampledToken. Returns that token's output. Raises ValueError in any other state."""
        self._take_done(request_id, "request", "admitted")
        return self.engine.admit_transferred(request_id, first_token)

    def keep_prefix(self, request_id: str) -> int:
        """Ends a pulled prefix's reservation whose KV has arrived (state DONE, as poll reported) with its blocks
        in the prefix cache, parked; returns how many. Raises ValueError in any other state."""
        self._take_done(request_id, "prefix", "kept")
        return self.engine.keep_transferred_prefix(request_id)

    def _take_done(self, request_id: str, what: str, done: str) -> None:
        """Forgets a transfer that is DONE (its agents too); raises ValueError naming its state otherwise."""
        entry = self._entries.get(request_id)
        if entry is None or entry.state is not TransferState.DONE:
            state = entry.state.value if entry else "unknown"
            raise ValueError(f"{what} {request_id!r} cannot be {done}: its KV transfer is {state}, not done")
        del self._entries[request_id]
        self.agents.release(entry.transfer_id)


class PrefillConnector(_Connector):
    def __init__(self, engine: LLMEngine, *, clock: Callable[[], float] = time.time):
        """engine must have been built with kv_agent=AgentFactory(...). Where its ranks' KV stores are shared
        with same-host receivers (AgentFactory.share_kv_store), each request's blocks are held past its end:
        until its transfer is DONE; when it ends otherwise, until every destination rank sent refs into the store
        has answered (it reads nothing after its ACK), or at the latest HOLD_GRACE_S past the transfer's lease (a
        receiver reads nothing past its lease). Checked at each poll."""
        super().__init__(engine, clock)
        self.holds = self.agents.shares_kv_store()
        self._holds_due: list[tuple[float, str]] = []  # (when, transfer id): holds to release then
        self._prefixes: set[str] = set()  # transfer ids of prefixes sent (their blocks are held, shared or not)

    def poll(self) -> list[TransferEvent]:
        if self._holds_due:
            now, due = self.clock(), []
            pending = self.agents.store_reads_pending([transfer_id for _, transfer_id in self._holds_due])
            for when, transfer_id in self._holds_due:
                if when <= now or transfer_id not in pending:
                    self.engine.release_held_blocks(transfer_id)
                else:
                    due.append((when, transfer_id))
            self._holds_due = due
        return super().poll()

    @property
    def num_pending(self) -> int:
        """Transfers not ended, and holds waiting for their release (the serving loop keeps polling for both)."""
        return super().num_pending + len(self._holds_due)

    def _left(self, entry: _Entry, done: bool) -> None:
        prefix = entry.transfer_id in self._prefixes
        self._prefixes.discard(entry.transfer_id)
        if not (self.holds or prefix):
            return
        if done or not self.holds:  # (without a shared store a prefix's blocks were copied out as it was sent)
            self.engine.release_held_blocks(entry.transfer_id)
        else:
            self._holds_due.append((entry.deadline + HOLD_GRACE_S, entry.transfer_id))

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               descriptor: TransferDescriptor, *, priority: int = 0, cache_salt: str | None = None,
               tenant: str | None = None) -> None:
        """Queues the prompt (one output token: the first) and arms the ranks to push its KV into descriptor
        as it is computed. Raises ValueError (bad request, KV formats differ, layouts of different models)."""
        if len(prompt_token_ids) != descriptor.num_tokens:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, the descriptor {descriptor.num_tokens}")
        if descriptor.lora != params.lora:  # KV of one adapter must never land in blocks reserved for another
            raise ValueError(f"the blocks were reserved for LoRA adapter {descriptor.lora!r}, but this request "
                             f"computes with {params.lora!r}")
        self.agents.arm(descriptor, f"{request_id}#0")
        if self.holds:
            self.engine.hold_blocks_after(request_id, descriptor.transfer_id)
        try:
            self.engine.add_request(request_id, prompt_token_ids, dataclasses.replace(params, max_tokens=1),
                                    priority=priority, cache_salt=cache_salt, tenant=tenant)
        except BaseException:
            self.agents.release(descriptor.transfer_id)
            if self.holds:
                self.engine.release_held_blocks(descriptor.transfer_id)
            raise
        self._entries[request_id] = _Entry(descriptor.transfer_id, descriptor.deadline)

    def send_prefix(self, request_id: str, block_hashes: Sequence[int], descriptor: TransferDescriptor) -> None:
        """Sends the cached blocks of block_hashes (a prefix another replica pulls; descriptor: its reservation
        of len(block_hashes) whole blocks) now, holding them until the transfer ends. request_id names the pull
        here (poll reports it). Raises LookupError if this replica no longer caches the whole prefix (nothing is
        held or sent then) and ValueError as submit() does."""
        if descriptor.num_tokens != len(block_hashes) * self.engine.config.block_size:
            raise ValueError(f"the descriptor holds {descriptor.num_tokens} tokens, not {len(block_hashes)} blocks")
        key = descriptor.transfer_id
        blocks = self.engine.hold_cached_prefix(key, block_hashes)
        if len(blocks) < len(block_hashes):
            self.engine.release_held_blocks(key)
            raise LookupError(f"only {len(blocks)} of the prefix's {len(block_hashes)} blocks are cached here")
        try:
            self.agents.arm(descriptor, None)
            self.agents.send_all(key, blocks)
        except BaseException:
            self.agents.release(key)
            self.engine.release_held_blocks(key)
            raise
        self._prefixes.add(key)
        self._entries[request_id] = _Entry(key, descriptor.deadline)

    _release_when_done = True  # a push acknowledged by every destination rank needs nothing more from here


def first_token_of(output: RequestOutput) -> SampledToken:
    """The SampledToken the prefill replica's first (and only) output carries, for DecodeConnector.admit."""
    if len(output.token_ids) != 1:
        raise ValueError(f"expected the prefill output's one token, got {len(output.token_ids)}")
    if output.logprobs:
        lp = output.logprobs[0]
        return SampledToken(lp.token_id, lp.logprob, lp.top_logprobs)
    return SampledToken(output.token_ids[0], None, ())
