"""Request state as the scheduler sees it: one Sequence per sample (a request with n samples has n).

A sequence is WAITING until first scheduled, RUNNING while it holds KV blocks, PREEMPTED after giving its
blocks back (it waits again and recomputes its tokens), and finished in one of the FINISHED_* states. The one
rule for "finished": `status.finished` is True, the sequence holds no blocks and is in no queue. WAITING_FOR_KV
is reserved for sequences whose KV arrives by transfer (kv_transfer, a later layer); WAITING_FOR_TIER for one
step while a sequence's prefix blocks are copied up from a KV tier (engine/core/kv_tiers.py).
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Sequence as Seq

from tandem.engine.kv.prefix_cache import BlockHasher, extend_block_hashes, hash_block_tokens, kv_salt
from tandem.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    WAITING_FOR_TIER = "waiting_for_tier"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort") of a finished status, else None."""
        return self.value if self.finished else None


@dataclass
class Sequence:
    """One sample of a request. Mutated only by the scheduler.

    Token counts are in tokens. num_computed_tokens counts tokens whose KV is in this sequence's blocks;
    num_cached_tokens is how many prompt tokens the prefix cache supplied when it was first scheduled.
    fork_seeds is non-empty on sample 0 of an n > 1 request until its prompt is computed: samples 1.. are forked
    from it then (sharing its blocks), one per seed.
    """

    seq_id: str
    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    priority: int
    arrival: int
    cache_salt: str | None
    block_size: int
    hasher: BlockHasher = hash_block_tokens
    fork_seeds: tuple[int, ...] = ()
    tenant: str | None = None  # who sent it (None: unknown): whose share it takes where the policy is fair

    def __post_init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.scheduled_at: float | None = None  # time.monotonic() at its first scheduling (set by the engine)
        self.queued_at = 0.0  # when it last entered the waiting queue (the scheduler's clock)
        self.order: tuple = ()  # its scheduling key, lower first (engine/core/scheduling_policy.py); () until queued
        self.block_hashes: list[int] = []
        self._tokens: list[int] = list(self.prompt_token_ids)
        self.hash_salt = kv_salt(self.cache_salt, self.params.lora)  # what the block hashes include
        extend_block_hashes(self.block_hashes, self._tokens, self.block_size, self.hash_salt, self.hasher)

    @property
    def token_ids(self) -> Seq[int]:
        """Prompt followed by output tokens. Callers must not mutate it."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last sampled token remains to be computed."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._tokens.append(token_id)
        if len(self._tokens) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self._tokens, self.block_size, self.hash_salt, self.hasher)

    def resume(self, output_token_ids: Seq[int]) -> None:
        """Starts the sequence with output tokens another replica already generated (a migrated request,
        engine/core/resume.py), appended as if sampled here: they join token_ids and the block hashes, so the first
        scheduling computes prompt + outputs (or finds them in the prefix cache), the sampler's next step is
        len(output_token_ids), and penalties and max_tokens count them as outputs. num_prompt_tokens stays the
        prompt's. Raises ValueError once the sequence has been scheduled or has outputs."""
        if self.status is not RequestStatus.WAITING or self.output_token_ids or self.num_computed_tokens:
            raise ValueError(f"sequence {self.seq_id} has started already: it cannot be resumed")
        for token_id in output_token_ids:
            self.append_token(int(token_id))

    def fork(self, index: int, seq_id: str, seed: int) -> Sequence:
        """A new sample of the same request at the same point: same tokens, hashes and computed count (copied,
        not recomputed), its own seed and no forks of its own."""
        child = copy.copy(self)
        child.seq_id, child.index, child.seed, child.fork_seeds = seq_id, index, seed, ()
        child.output_token_ids = list(self.output_token_ids)
        child.block_hashes = list(self.block_hashes)
        child._tokens = list(self._tokens)
        child.num_preemptions = 0
        return child


def token_stop_status(seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int) -> RequestStatus | None:
    """The finished status the last appended token puts the sequence in, or None if it goes on.
    Stop strings are checked on text, by the engine's output processor, not here."""
    params, last = seq.params, seq.output_token_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
