"""What the scheduler tells the model runner each step, and what the runner answers. Frozen, torch-free.

Sequences new to the runner (first scheduled, or resumed after preemption) arrive in full; sequences it
already knows arrive as diffs. The runner applies, in order: drop finished_seq_ids, add new_seqs, update
cached_seqs, perform block_copies, run the model, sample every sequence whose computed tokens reach its last
token, and sample each fork's child from its parent's logits.

KV tiers (engine/core/kv_tiers.py): tier_ops are copies between the device's blocks, host slots and disk files,
run in order beside the step: tier_ops.ops[:sync] before block_copies and the model (they read blocks this step
writes), the rest on a copy thread while the model runs; all are done when the runner answers, and the answer
names the blocks a disk read or write failed for (RunnerOutput.tiers).

Speculative decoding (engine/decoding/speculation.py): a decoding sequence with spec_tokens computes its last token and
those proposals as one chunk (its num_scheduled_tokens counts them all); the runner verifies them and answers the
tokens it emits: the accepted proposals and one more (engine/decoding/rejection_sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewSequenceData:
    """token_ids: prompt then the outputs so far. num_computed_tokens: tokens whose KV is in block_ids before
    this step (prefix-cache hits included)."""

    seq_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class CachedSequenceData:
    """new_block_ids are appended to the runner's table; block_ids, when set, replaces the whole table first
    (an entry changed in place: copy-on-write)."""

    seq_id: str
    num_computed_tokens: int
    new_block_ids: tuple[int, ...]
    block_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ForkData:
    """child_id is a new sample of parent_id's request: it starts with the parent's tokens and block table (as
    they are before this step's sampled token) and samples its first token from the parent's logits."""

    parent_id: str
    child_id: str
    index: int  # the child's sample index within its request
    seed: int


@dataclass(frozen=True)
class SaveBlocks:
    """Device blocks[i] (every layer, K and V) into host slots[i]."""

    blocks: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class SpillBlock:
    """Host slot `slot`, holding block `block_hash`, into the disk tier's file for that hash."""

    slot: int
    block_hash: int


@dataclass(frozen=True)
class DropBlock:
    """Deletes the disk tier's file of block_hash (it left the tier)."""

    block_hash: int


@dataclass(frozen=True)
class FetchBlock:
    """The disk tier's file of block_hash, checked, into host slot `slot`; a miss is reported, never copied."""

    block_hash: int
    slot: int


@dataclass(frozen=True)
class LoadBlocks:
    """Host slots[i] into device blocks[i], one sequence's run of prefix blocks (hashes[i] each) in order: the run
    stops at the first block whose fetch failed earlier in the step (the rest is recomputed)."""

    slots: tuple[int, ...]
    blocks: tuple[int, ...]
    hashes: tuple[int, ...]


TierOp = SaveBlocks | SpillBlock | DropBlock | FetchBlock | LoadBlocks


@dataclass(frozen=True)
class TierOps:
    """One step's tier copies, in the order they must happen; ops[:sync] before the step writes any block.
    reports: whether any op touches the disk (every rank then answers the step with its failures)."""

    ops: tuple[TierOp, ...] = ()
    sync: int = 0

    @property
    def reports(self) -> bool:
        return any(isinstance(op, (SpillBlock, FetchBlock)) for op in self.ops)


@dataclass(frozen=True)
class LoRAChange:
    """An adapter registered under `name` from the PEFT folder `path` (engine/loader/lora_adapter.py), or
    unregistered (path None): every rank learns it with the next step and reads the adapter when a step uses it."""

    name: str
    path: str | None


@dataclass(frozen=True)
class SchedulerOutput:
    new_seqs: tuple[NewSequenceData, ...] = ()
    cached_seqs: tuple[CachedSequenceData, ...] = ()
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)  # read-only by contract
    forks: tuple[ForkData, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()  # (source, destination)
    finished_seq_ids: frozenset[str] = frozenset()  # finished, aborted or preempted since the last step
    spec_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # seq id -> proposed tokens
    tier_ops: TierOps = TierOps()
    lora_changes: tuple[LoRAChange, ...] = ()  # set by the engine: adapters registered or gone since the last step

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(frozen=True)
class TierReport:
    """How a step's tier copies went on a rank: failed holds (block hash, why) for each failed disk read or
    write; times holds (tier, blocks, seconds) for each copy up: "host" for host -> device (a LoadBlocks run),
    "disk" for one disk -> host read."""

    failed: tuple[tuple[int, str], ...] = ()
    times: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True)
class RunnerOutput:
    """The token sampled for each sequence that reached its last token this step (fork children included), and
    for a sequence that speculated, the tokens it emitted after that one (its accepted proposals but the first,
    then the correction or bonus token): len(speculated[seq id]) proposals were accepted."""

    sampled: Mapping[str, SampledToken] = field(default_factory=dict)
    speculated: Mapping[str, tuple[SampledToken, ...]] = field(default_factory=dict)
    tiers: TierReport = TierReport()  # how the step's KV tier copies went

    def with_tiers(self, report: TierReport) -> RunnerOutput:
        return RunnerOutput(self.sampled, self.speculated, report)

    def token_ids(self, seq_id: str) -> tuple[int, ...]:
        """Every token the sequence emitted this step, in order."""
        return (self.sampled[seq_id].token_id, *(t.token_id for t in self.speculated.get(seq_id, ())))
