"""Speculative decoding's draft-model proposer: a smaller (or cheaper) model of the same vocabulary proposes the
target's next tokens by decoding ahead greedily (engine/decoding/speculation.py picks how far).

The draft "self" is the target in a cheaper form: the GGUF file's own 4-bit weights run packed in bfloat16
(engine/models/int4.py), about 3x cheaper per step than the float32 target on a CPU, with no second download. Any
other model folder or file sharing the target's vocabulary works too.

The draft keeps its own paged KV cache, with its own block pool (its blocks are not the target's), in the engine's
process. Per sequence it remembers the tokens whose KV it holds (`fed`: the sequence's tokens, then the proposals
it fed itself). A proposal round compares them with the sequence's real tokens: KV past the first difference (a
rejected proposal) is simply overwritten. It then computes the tokens it lacks as one chunk (the whole prompt the
first time, on the decode side of a disaggregated cluster too: the draft builds its KV from the transferred
prompt's tokens), draws the next token, and feeds each proposal back for the next, one batched forward pass per
proposed position for all the sequences at once. A sequence whose KV the draft's pool cannot hold gets no proposal.

The draw is the target's own sampler on the draft's logits, with the request's settings and the seed of the output
step proposed (greedy requests: the argmax). Verification emits the target's draws for those steps
(engine/decoding/rejection_sampler.py accept_drawn), which share that randomness: where the draft's distribution is
close to the target's, both draws land on the same token, and the output is exactly the target's, sampled or greedy.
(The independent-draw rule, accept with min(1, p/q), is rejection_sampler.verify_sampled; coupling the draws keeps the
output identical to decoding without speculation, which that rule does not.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.decoding.sampler import SampleRequest, sample_batch
from tandem.engine.decoding.speculation import StepCost
from tandem.engine.engine_config import SELF_DRAFT
from tandem.engine.kv.block_pool import BlockPool
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.models.step import run_step
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.loader.model_loader import LoadedModel
    from tandem.engine.models import LlamaModel
    from tandem.engine.request import Sequence as Seq

SELF = SELF_DRAFT
_GREEDY = SamplingParams(temperature=0)


def load_draft(target: LoadedModel, draft: str, device: torch.device) -> LoadedModel:
    """The draft model: `draft` is SELF (the target's GGUF, packed 4-bit: the CPU only) or a model path. Raises
    ValueError when it cannot be loaded or cannot serve as this target's draft (SELF off the CPU, no packed layers,
    another vocabulary)."""
    from tandem.engine.loader import load_model
    from tandem.engine.models.block_linear import BlockLinear
    from tandem.engine.models.int4 import Int4Linear

    if draft == SELF:
        if device.type != "cpu":
            raise ValueError(f"the draft 'self' runs the target's GGUF weights packed 4-bit, which only the CPU runs "
                             f"(torch's int4 CPU kernel); on {device.type} name a smaller model of the same "
                             "vocabulary as the draft (speculative.draft)")
        loaded = load_model(target.source, dtype=torch.bfloat16, device=device, weight_format="packed",
                            progress=False)
        if not any(isinstance(p, (Int4Linear, BlockLinear)) for p in loaded.model.projections()):
            raise ValueError(f"{target.source} has no 4-bit (Q4_0/Q4_1) layers to run packed: the draft 'self' "
                             "needs them; name a smaller model of the same vocabulary as the draft instead")
    else:
        loaded = load_model(draft, device=device, progress=False)  # ModelLoadError is a ValueError
    if loaded.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({loaded.config.vocab_size} tokens) is not the target's "
                         f"({target.config.vocab_size})")
    return loaded


def _shared_prefix(fed: Sequence[int], token_ids: Sequence[int], limit: int) -> int:
    """How many leading tokens (at most limit) the draft's KV holds as they are in the sequence."""
    same = 0
    while same < limit and fed[same] == token_ids[same]:
        same += 1
    return same


@dataclass
class _DraftSeq:
    fed: list[int] = field(default_factory=list)  # tokens whose KV the draft holds, by position
    blocks: list[int] = field(default_factory=list)


class DraftProposer:
    """model: the draft (its attention backend set); num_blocks: its own KV pool; compiled: its compiled decode
    step or None."""

    name = "draft"

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, compiled=None):
        self.model = model
        self.block_size = block_size
        self.compiled = compiled
        c = model.config
        self.kv_cache = PagedKVCache(KVCacheSpec(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                                 model.dtype), model.device)
        self.pool = BlockPool(num_blocks)
        self.cost = StepCost()  # the draft's forward passes: tokens -> seconds
        self._seqs: dict[str, _DraftSeq] = {}

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[tuple[Seq, int]]) -> dict[str, list[int]]:
        """Up to k tokens for each (sequence, k), decoded by the draft in batched passes. Each proposal is drawn by
        the target's own sampler from the draft's logits, with the request's settings and the seed of the output
        step it proposes (greedy: the argmax): where the draft's distribution is close to the target's, the
        target's draw for that step is then the same token."""
        rows = []  # (sequence, its draft state, k)
        for seq, k in requests:
            state = self._seqs.setdefault(seq.seq_id, _DraftSeq())
            if k > 0 and self._room(state, seq.num_tokens + k - 1):
                rows.append((seq, state, k))
        if not rows:
            return {}
        # The first pass: what each sequence's draft KV lacks, up to its last token.
        chunks = []
        for seq, state, _ in rows:
            # The last token is computed again even when held: its pass gives the first proposal.
            same = _shared_prefix(state.fed, seq.token_ids, min(len(state.fed), seq.num_tokens - 1))
            del state.fed[same:]
            chunks.append((list(seq.token_ids[same:]), same))
        proposals: dict[str, list[int]] = {seq.seq_id: [] for seq, _, _ in rows}
        for step in range(max(k for *_, k in rows)):
            live = [i for i, (*_, k) in enumerate(rows) if k > step]
            drawn = self._forward([chunks[i] for i in live], [rows[i][1] for i in live],
                                  [SampleRequest.after(seq.params, seq.seed, seq.token_ids, seq.num_prompt_tokens,
                                                       proposals[seq.seq_id]) for seq in (rows[i][0] for i in live)])
            for i, token in zip(live, drawn):
                seq, state, _ = rows[i]
                state.fed.extend(chunks[i][0])
                proposals[seq.seq_id].append(token)
                chunks[i] = ([token], len(state.fed))
        return proposals

    @torch.inference_mode()
    def warm_up(self, max_batch: int, rounds: int = 3) -> None:
        """Times the draft's pass for one sequence and for max_batch (one token each, the compiled buckets) on
        scratch blocks, so that the cost model prices a draft before any request pays for it."""
        size = max(1, min(max_batch, self.pool.num_free))
        blocks = self.pool.allocate(size)
        try:
            states = [_DraftSeq(blocks=[b]) for b in blocks]
            batches = [(n, [([0], 0)] * n, [SampleRequest(_GREEDY, 0, 0, (), ())] * n) for n in sorted({1, size})]
            for n, chunks, requests in batches:  # first calls are slow (allocation, caches): not counted
                self._forward(chunks, states[:n], requests)
            self.cost = StepCost()
            for _ in range(rounds):
                for n, chunks, requests in batches:
                    self._forward(chunks, states[:n], requests)
        finally:
            for b in blocks:
                self.pool.decref(b, park=False)

    def missing(self, seq: Seq) -> int:
        """How many of seq's tokens the draft's KV lacks (all of them for a sequence it has not seen): what its
        next round computes first."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return seq.num_tokens
        return seq.num_tokens - _shared_prefix(state.fed, seq.token_ids, min(len(state.fed), seq.num_tokens))

    def _room(self, state: _DraftSeq, num_tokens: int) -> bool:
        """Blocks for num_tokens positions; False (taking none) when the pool has too few."""
        need = -(-num_tokens // self.block_size) - len(state.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        state.blocks.extend(self.pool.allocate(need))
        return True

    def _forward(self, chunks: list[tuple[list[int], int]], states: list[_DraftSeq],
                 requests: list[SampleRequest]) -> list[int]:
        """Computes each (tokens, start position) chunk into the draft's cache; returns the token drawn after each
        (by its sampler row)."""
        start = time.perf_counter()
        device = self.model.device
        meta = AttentionMetadata.build([len(t) for t, _ in chunks], [s for _, s in chunks],
                                       [state.blocks for state in states], self.block_size, device)
        ids = torch.tensor([t for tokens, _ in chunks for t in tokens], dtype=torch.int64, device=device)
        positions = torch.tensor([p for tokens, s in chunks for p in range(s, s + len(tokens))], dtype=torch.int64,
                                 device=device)
        hidden = run_step(self.model, ids, positions, meta, self.kv_cache, compiled=self.compiled)
        last = torch.tensor(meta.query_start_loc[1:], device=device) - 1
        drawn = [t.token_id for t in sample_batch(self.model.compute_logits(hidden[last]), requests)]
        self.cost.observe(len(ids), time.perf_counter() - start)
        return drawn

    def forget(self, seq_id: str) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            for block in reversed(state.blocks):
                self.pool.decref(block, park=False)

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_in_use
