"""Property tests: any sequence of allocate / fork / append / free / evict on the KV cache manager keeps every
invariant, and no block is ever handed to a second owner or written while someone else can read it."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.core.kv_cache_manager import KVCacheManager
from tandem.engine.request import Sequence
from tandem.engine.sampling_params import SamplingParams

from tests.engine.scheduler_harness import Harness

BLOCK = 4
PARAMS = SamplingParams(max_tokens=64, temperature=0)
tokens = st.lists(st.integers(1, 3), min_size=1, max_size=14)  # a tiny alphabet makes shared prefixes common


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(24, BLOCK)
        self.seqs: dict[str, Sequence] = {}
        self.slots: dict[int, list[int | None]] = {}  # block -> the token whose KV each slot holds
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _write(self, seq: Sequence, count: int) -> None:
        """Writes KV for seq's next `count` tokens, checking what it can already see and who owns the blocks."""
        table = self.kv.block_table(seq.seq_id)
        for pos in range(seq.num_computed_tokens):
            assert self.slots[table[pos // BLOCK]][pos % BLOCK] == seq.token_ids[pos], f"{seq.seq_id} reads stale KV"
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + count):
            block = table[pos // BLOCK]
            assert self.kv.pool.ref_count(block) == 1, f"block {block} written while shared"
            assert not self.kv.cache.is_cached(block), f"cached block {block} overwritten"
            self.slots.setdefault(block, [None] * BLOCK)[pos % BLOCK] = seq.token_ids[pos]
        seq.num_computed_tokens += count
        self.kv.cache_full_blocks(seq)

    def _allocate(self, seq: Sequence, count: int, match=None) -> bool:
        before = {b for s in self.seqs.values() for b in self.kv.block_table(s.seq_id)}
        allocation = self.kv.allocate(seq, count, match) if match else self.kv.allocate(seq, count)
        if allocation is None:
            return False
        assert not set(allocation.new_blocks) & before, "a block in use was handed out again"
        for src, dst in allocation.copies:
            assert dst not in before
            self.slots[dst] = list(self.slots.get(src, [None] * BLOCK))
        return True

    @rule(prompt=tokens, salt=st.sampled_from([None, None, "t1"]))
    def allocate(self, prompt, salt):
        seq = Sequence(self._new_id(), "r", 0, tuple(prompt), PARAMS, 0, 0, 0, salt, BLOCK)
        match = self.kv.match_prefix(seq)
        for i, block in enumerate(match.blocks):  # a hit must hold exactly this prefix
            assert self.slots[block] == list(prompt[i * BLOCK:(i + 1) * BLOCK])
        if self._allocate(seq, seq.num_tokens - match.num_cached_tokens, match):
            seq.num_computed_tokens = match.num_cached_tokens
            self.seqs[seq.seq_id] = seq
            self._write(seq, seq.num_tokens - seq.num_computed_tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def append(self, data, new):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        for token in new:
            seq.append_token(token)
        if self._allocate(seq, len(new)):
            self._write(seq, len(new))
        else:  # no room: give everything back, as a preemption would
            self.kv.free(seq)
            del self.seqs[seq.seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        child = parent.fork(1, self._new_id(), 1)
        self.kv.fork(parent, child)
        self.seqs[child.seq_id] = child

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        self.kv.free(seq)

    @rule()
    def evict(self):
        self.kv.reset_prefix_cache()
        assert self.kv.pool.num_parked == 0

    @invariant()
    def integrity(self):
        self.kv.check_integrity()
        pool = self.kv.pool
        assert pool.num_free + pool.num_parked + pool.num_in_use == pool.num_blocks


TestKVManager = KVManagerMachine.TestCase
TestKVManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SchedulerMachine(RuleBasedStateMachine):
    """Whole-scheduler version: requests with shared prefixes, n > 1 and salts come and go under a small pool;
    the fake runner raises if any sequence would read KV that is not its own tokens."""

    def __init__(self):
        super().__init__()
        self.h = Harness(num_blocks=20, block_size=BLOCK, max_num_batched_tokens=10, max_num_seqs=6,
                         max_model_len=60)
        self.count = 0

    @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=24), max_tokens=st.integers(1, 12),
          n=st.integers(1, 3), priority=st.integers(0, 2), salt=st.sampled_from([None, "t"]))
    def add(self, prompt, max_tokens, n, priority, salt):
        self.count += 1
        self.h.add(f"q{self.count}", prompt, max_tokens, n=n, priority=priority, seed=self.count, salt=salt)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.h.step()

    @precondition(lambda self: self.h.scheduler.seqs)
    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from(sorted({s.request_id for s in self.h.scheduler.seqs.values()})))
        self.h.scheduler.abort_request(request)

    @invariant()
    def integrity(self):
        self.h.scheduler.check_integrity()

    def teardown(self):
        self.h.run()
        assert self.h.kv.pool.num_in_use == 0


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
