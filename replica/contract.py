"""The contract between the router (and the control plane) and the replicas: what each replica offers, as
Protocols, and every value that crosses that line, as frozen dataclasses. Plain Python: the router imports this
without the model runtime.

The worker actors implement the Protocols (prefill_worker/replica.py, decode_worker/replica.py); the router
calls them through replica/remote.py, which puts a Ray actor handle behind the same Protocol, and tests and
bench/routing.py through the mock replicas of router/mocks/replicas.py. A method that streams yields lists of
RequestOutput: everything the engine produced since the last item, so one message per engine step at most.
ResumeState (engine/core/resume.py, torch-free) crosses this line too: what a migrated request had delivered.
The calls that serve a request take `tenant`, who sent it (None: authentication is off), whose share it takes
where a pool's scheduler is fair, and `trace`: the W3C traceparent of the router's span for the request when the
router traces it (router/tracing.py), under which the replica writes its own spans (replica/tracing.py); None:
not traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence, Union

from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.core.kv_tiers import TierHitCosts, TierStats
from tandem.engine.decoding.speculation import SpeculationStats
from tandem.engine.hardware.device import RankPlacement
from tandem.engine.kv.kv_events import KVEventBatch, KVSnapshot
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferDescriptor
from tandem.kv_transfer.drops import MessageDrops

POOLS = ("prefill", "decode")


class RequestAbortedError(RuntimeError):
    """The request was aborted before this call reached the replica (calls and aborts race across processes)."""


@dataclass(frozen=True)
class ReplicaInfo:
    """Static facts about a started replica, for the router and the control plane. node: the address other
    nodes reach it at; node_id: Ray's node id (None outside Ray); layout: one line per rank; kv_addresses: the
    replica's KV transfer agent addresses, one per rank (empty for a colocated replica): where a prefill
    replica's descriptor pushes to, and the only peers a decode replica answers about a transfer (the router
    names the prefill replica's to reserve()); device: what the ranks compute on (engine/hardware/device.py
    DeviceChoice.describe()); ranks: where each rank runs, as it reports itself; weights and kv_dtype: how its
    weights and its KV cache are stored."""

    name: str
    pool: str
    pid: int
    node: str
    node_id: str | None
    layout: tuple[str, ...]
    world_size: int
    max_model_len: int
    block_size: int  # tokens per KV block
    kv_blocks_total: int
    kv_addresses: tuple[str, ...] = ()
    device: str = "cpu"
    ranks: tuple[RankPlacement, ...] = ()
    weights: str = "dense"  # how its projections are held (engine_config.WEIGHT_FORMATS)
    kv_dtype: str = "float32"  # what its KV cache stores (engine/kv/kv_cache.py KV_STORAGE names)
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters it served when it started (by name)


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's counters, read between engine steps. state: "ready", or "failed" once its engine died (the
    counters are then its last ones). Requests and blocks are counts; kv_usage and prefix_hit_rate fractions.
    kv_messages_dropped: KV transfer messages its ranks' agents dropped, by reason, summed over ranks (forged,
    malformed, oversized, for unknown transfers, late; kv_transfer/drops.py). kv_messages_by_reference: KV data
    messages its ranks' agents sent by reference to replicas of the same host (kv_transfer/shm.py).
    stream_frames: output batches its streams wrote on token channels (replica/token_channel.py)."""

    name: str
    pool: str
    state: str
    running: int
    waiting: int
    waiting_for_kv: int
    kv_blocks_total: int
    kv_blocks_in_use: int
    kv_blocks_cached: int
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions: int
    num_steps: int
    kv_messages_dropped: MessageDrops = MessageDrops()
    kv_messages_by_reference: int = 0
    kv_bytes_sent: int = 0  # KV payload bytes its ranks' agents sent, summed over ranks
    kv_bytes_received: int = 0  # and received (authentic DATA written into blocks)
    stream_frames: int = 0
    ranks_alive: tuple[bool, ...] = ()  # whether each rank's process runs, in rank order
    speculation: SpeculationStats | None = None  # its speculative decoding's counters; None: it does not speculate
    kv_tiers: TierStats | None = None  # its KV tiers' use, hits, copies and failures; None: no tiers
    kv_tier_hit_costs: TierHitCosts | None = None  # what a hit on each tier costs against recomputing; None: no tiers


@dataclass(frozen=True)
class KVEventsReply:
    """One answer to kv_events(): the replica's KV events from the asked position on (a KVEventBatch), or a
    snapshot of its prefix cache and tiers (a KVSnapshot) when those are gone, plus its free KV blocks after its
    last step, what a hit on each of its KV tiers costs (None: it has none) and its measured prefill speed
    (None: it has not prefilled yet)."""

    events: Union[KVEventBatch, KVSnapshot]
    kv_blocks_free: int
    tier_hit_costs: TierHitCosts | None = None
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill replica answers once the decode replica holds the prompt's KV: the first token (for
    DecodeReplicaAPI.decode), how many prompt tokens came from its prefix cache, and the part of the transfer that
    layer-wise sending did not hide behind the prefill (transfer_s), and how long the prompt waited in the
    replica's queue (queue_s)."""

    first_token: SampledToken
    num_prompt_tokens: int
    num_cached_tokens: int
    transfer_s: float = 0.0  # after the first token was sampled, how long the KV transfer still took (seconds)
    queue_s: float = 0.0  # from the call to the engine's first scheduling of the prompt (seconds)


class ReplicaAPI(Protocol):
    """What every replica answers, prefill or decode."""

    async def ready(self) -> ReplicaInfo:
        """Returns once the replica's engine (and every rank) is up."""

    async def stats(self) -> ReplicaStats: ...

    async def health(self) -> str | None:
        """None while the replica can serve, else why it cannot (its engine failed, one of its rank processes
        died). Answers at once, never waiting for a running engine step: the control plane's heartbeat."""

    async def kv_events(self, epoch: str | None, since: int) -> KVEventsReply:
        """The KV events from `since` on in the log of `epoch` (epoch None, an epoch that is not the log's, or
        events the log no longer keeps: a snapshot). Raises ValueError if the replica publishes no events."""

    async def abort(self, request_id: str) -> None:
        """Ends the request wherever it is here and frees its blocks; a later call for the same id is refused
        (RequestAbortedError). Unknown ids are remembered, not an error."""

    async def check_integrity(self) -> None:
        """Raises ValueError if the replica's KV bookkeeping or any rank's KV agent is inconsistent."""

    async def reserve_prefix(self, pull_id: str, prefix_token_ids: Sequence[int], *, cache_salt: str | None = None,
                             senders: tuple[str, ...] = ()) -> TransferDescriptor | None:
        """A prefix pull's puller (router/prefix_pulls.py): holds blocks for prefix_token_ids (whole blocks) and
        returns where the replica at senders (its kv_addresses) sends them: the prefix's last
        descriptor.num_tokens tokens' blocks (those it does not cache already). None when there is no room now.
        Raises ValueError on a replica without KV agents (colocated)."""

    async def send_prefix(self, pull_id: str, block_hashes: tuple[int, ...], descriptor: TransferDescriptor, *,
                          prefix_token_ids: tuple[int, ...] = (), cache_salt: str | None = None) -> None:
        """A prefix pull's holder: sends its cached blocks of block_hashes into descriptor now; returns once every
        destination rank acknowledged them. prefix_token_ids: the prefix up to the last of block_hashes, given
        when some of its blocks are only on this replica's KV tiers: they are brought up to the device first (a
        one-token request of the prefix, with cache_salt). Raises LookupError if it does not cache them all
        (on its device, after that), TransferFailedError if the transfer failed."""

    async def keep_prefix(self, pull_id: str) -> int:
        """A prefix pull's puller: waits for the prefix's KV and keeps it in the prefix cache; returns its blocks.
        Raises TransferFailedError if it did not arrive (nothing is held then)."""

    async def load_lora(self, name: str, path: str) -> float:
        """Serves the LoRA adapter in the PEFT folder `path` (as every node reads it) as `name`; returns the seconds
        its check took. Raises ValueError with the reason (a bad adapter, a replica without LoRA)."""

    async def unload_lora(self, name: str) -> None:
        """Stops serving adapter `name`. Raises ValueError with the reason: not loaded (the engine's
        UnknownAdapterError), or in use."""

    async def shutdown(self) -> None:
        """Stops the engine and its ranks."""


class PrefillReplicaAPI(ReplicaAPI, Protocol):
    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0, cache_salt: str | None = None,
                      tenant: str | None = None, trace: str | None = None) -> PrefillResult:
        """Computes the prompt (reusing this replica's prefix cache; cache_salt: the tenant's salt), pushes its
        KV layer by layer into the decode replica's reservation and returns once every destination rank has
        acknowledged it. Raises ValueError for a request it cannot serve, TransferFailedError if the KV did not
        arrive (nothing is held here then), RequestAbortedError after abort()."""


class DecodeReplicaAPI(ReplicaAPI, Protocol):
    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None, senders: tuple[str, ...] = (),
                      tenant: str | None = None, waited_s: float = 0.0) -> TransferDescriptor | None:
        """Holds KV blocks for the prompt and returns where the prefill replica pushes it; None when there is
        no room now (nothing held: try another replica or later). senders: the prefill replica's kv_addresses
        (ReplicaInfo), the only peers this replica's agents tell how the transfer went (empty: nobody; the
        prefill replica then learns it from its lease). waited_s: how long the request has waited for room so
        far (the router's decode room); past the pool's scheduler.preempt_after_s, a request of higher priority
        than running ones preempts them for room (engine/core/scheduling_policy.py). Raises ValueError for a
        request it cannot serve or on a colocated replica (it takes no transfers)."""

    def decode(self, request_id: str, first_token: SampledToken, *,
               trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Waits for the reserved request's KV, continues it from first_token and streams its outputs (the
        first carries first_token). Raises TransferFailedError if the transfer ended badly (blocks are free)."""

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                 trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Prefills and decodes the request here (colocated mode, n > 1, conditional disaggregation, or after a
        failed transfer) and streams its outputs."""

    def resume(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               resume: ResumeState, *, priority: int = 0, cache_salt: str | None = None,
               tenant: str | None = None, trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Continues here a request (n == 1) another decode replica was serving when it died (the router's
        migration by token replay): prefills the prompt plus resume.output_token_ids (the tokens the client was
        already sent), draws with resume.seed from the step after them, and streams only what comes after them,
        the first text delta included; outputs report the prompt's num_prompt_tokens. request_id is the
        router's fresh id for this attempt. Raises ValueError for a request it cannot resume (n > 1, delivered
        tokens that already end it, or as generate())."""


@dataclass(frozen=True)
class DecodeCall:
    """DecodeReplicaAPI.decode as a message: what a stream over the token channel (or a Ray streaming call) runs
    on the replica. Each stream call opens its own method, by reference: no method name crosses the line."""

    request_id: str
    first_token: SampledToken
    trace: str | None = None

    def open(self, replica: DecodeReplicaAPI) -> AsyncIterator[list[RequestOutput]]:
        return replica.decode(self.request_id, self.first_token, trace=self.trace)


@dataclass(frozen=True)
class GenerateCall:
    """DecodeReplicaAPI.generate as a message (see DecodeCall)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    trace: str | None = None
    tenant: str | None = None

    def open(self, replica: DecodeReplicaAPI) -> AsyncIterator[list[RequestOutput]]:
        return replica.generate(self.request_id, self.prompt_token_ids, self.params, priority=self.priority,
                                cache_salt=self.cache_salt, tenant=self.tenant, trace=self.trace)


@dataclass(frozen=True)
class ResumeCall:
    """DecodeReplicaAPI.resume as a message (see DecodeCall)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    resume: ResumeState
    priority: int = 0
    cache_salt: str | None = None
    trace: str | None = None
    tenant: str | None = None

    def open(self, replica: DecodeReplicaAPI) -> AsyncIterator[list[RequestOutput]]:
        return replica.resume(self.request_id, self.prompt_token_ids, self.params, self.resume,
                              priority=self.priority, cache_salt=self.cache_salt, tenant=self.tenant,
                              trace=self.trace)


StreamCall = Union[DecodeCall, GenerateCall, ResumeCall]
STREAM_CALLS = (DecodeCall, GenerateCall, ResumeCall)


@dataclass(frozen=True)
class ReadyReplica:
    """A started replica as the control plane hands it to the router: its API and its info."""

    name: str
    pool: str  # one of POOLS
    api: PrefillReplicaAPI | DecodeReplicaAPI
    info: ReplicaInfo
