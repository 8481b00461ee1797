"""A model runner without a model, for scheduler tests: it keeps the runner's mirror of every sequence exactly as
the real one does, stores in each KV slot the token id whose KV it would hold, and checks before every step
that each scheduled sequence would read the right token at every earlier position (block tables, prefix-cache
hits and copy-on-write all included). Tokens are a deterministic function of the sequence so far and its seed,
so a preempted-and-recomputed sequence must produce the same ones."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tandem.engine.scheduler_output import RunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class FakeSample:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple = ()


def next_token(tokens, seed: int, vocab: int = 97) -> int:
    digest = hashlib.blake2b(repr((tuple(tokens), seed)).encode(), digest_size=4).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab - 3)


class KVMismatch(AssertionError):
    pass


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[str, dict] = {}
        self.tokens_computed = 0

    def execute_step(self, out: SchedulerOutput) -> RunnerOutput:
        for seq_id in out.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in out.new_seqs:
            self.seqs[new.seq_id] = {"tokens": list(new.token_ids), "blocks": list(new.block_ids), "seed": new.seed}
        for diff in out.cached_seqs:
            state = self.seqs[diff.seq_id]
            state["blocks"] = list(diff.block_ids) if diff.block_ids is not None else state["blocks"] + list(diff.new_block_ids)
        for src, dst in out.block_copies:
            self.slots[dst] = list(self.slots[src])
        computed = {d.seq_id: d.num_computed_tokens for d in (*out.new_seqs, *out.cached_seqs)}
        bs = self.block_size
        written: dict[tuple[int, int], str] = {}
        for seq_id, count in out.num_scheduled_tokens.items():
            state, start = self.seqs[seq_id], computed[seq_id]
            for pos in range(start):
                held = self.slots[state["blocks"][pos // bs]][pos % bs]
                if held != state["tokens"][pos]:
                    raise KVMismatch(f"{seq_id} position {pos}: KV of token {held}, expected {state['tokens'][pos]}")
            for pos in range(start, start + count):
                slot = (state["blocks"][pos // bs], pos % bs)
                if slot in written:
                    raise KVMismatch(f"{seq_id} and {written[slot]} write the same slot {slot} in one step")
                written[slot] = seq_id
                self.slots[slot[0]][slot[1]] = state["tokens"][pos]
            self.tokens_computed += count
        sampled = {}
        for seq_id, count in out.num_scheduled_tokens.items():
            state = self.seqs[seq_id]
            if computed[seq_id] + count == len(state["tokens"]):
                sampled[seq_id] = FakeSample(next_token(state["tokens"], state["seed"]))
        for fork in out.forks:
            parent = self.seqs[fork.parent_id]
            self.seqs[fork.child_id] = {"tokens": list(parent["tokens"]), "blocks": list(parent["blocks"]),
                                        "seed": fork.seed}
            sampled[fork.child_id] = FakeSample(next_token(parent["tokens"], fork.seed))
        for seq_id, sample in sampled.items():
            self.seqs[seq_id]["tokens"].append(sample.token_id)
        return RunnerOutput(sampled)


def expected_output(prompt, seed: int, max_tokens: int, eos: frozenset[int] = frozenset()) -> list[int]:
    """What a sequence produces alone: the same function, no batching."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(tokens, seed)
        tokens.append(token)
        out.append(token)
        if token in eos:
            break
    return out
