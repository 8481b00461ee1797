"""The order a scheduler serves its sequences in (SchedulingConfig.policy, a pool's `scheduler.policy`), and which
running sequences a waiting one of higher priority may preempt. Plain Python, clock injected.

Every sequence gets an ordering key (Sequence.order) when it first enters the waiting queue; lower goes first,
for the waiting queue, for the running sequences' prefill chunks and, reversed, for choosing whom to preempt
when blocks run out:

  fcfs      (arrival, sample index)
  priority  (priority, arrival, sample index)                     lower priority values first
  sjf       (1, prompt tokens, max_tokens, arrival, sample index) shortest first; once a sequence has waited
            (0, arrival, sample index)                            sjf_aging_s it goes before every one that has
                                                                  not (aged, in arrival order): nothing starves
  fair      (start tag, arrival, sample index)                    start-time fair queueing over tokens

sjf also lets a waiting prompt shorter than a running one go first: the step keeps room for the waiting sequences
whose key is smaller than a running prompt's (and that can start), and the running prompt's next chunk takes what
is left (SchedulingPolicy.ahead_of); a running prompt that first entered the queue sjf_aging_s ago keeps its room.

fair: requests are ordered by start-time fair queueing, and each step's prompt tokens are shared between the
tenants with prompt tokens to compute (running prefills and waiting requests) by weighted max-min fairness
(StepShares): a tenant gets at most its weight's share of the budget the decodes leave, more while others need
less; the first waiting request in this order, when its tenant has the fewest prompt tokens to compute, gets the
step's prompt tokens alone, in at most half of the steps (SchedulingPolicy.shares). With fair_reserve_s, a tenant
that had a sequence here within that time keeps its share though it has no prompt to compute: the step is not
filled with the others' prompts (not work-conserving), so a request of a tenant that just finished one, or is
decoding, waits behind a shorter step. Each tenant's requests get
start tags S = max(V, the finish tag of the tenant's previous request) and finish tags F = S + cost / weight,
cost being the tokens the request may compute (its prompt and max_tokens for each sample) and weight its
tenant's (SchedulingConfig.weight); V, the virtual time, is the largest start tag among the sequences started.
A tenant that sends many or long requests pushes its own later requests back, one that was idle comes in at V
without credit for the idle time, and while tenants contend each gets tokens in proportion to its weight. A
preempted sequence keeps its key.

Priority preemption (preempt_after_s set, any policy but fcfs): a waiting sequence that has waited that long
(since it last entered the queue) and has running sequences of lower priority (a larger value) is urgent; the
scheduler preempts those, the ones that lose the least computed work first, until it can start
(Scheduler._start_urgent). A request whose KV arrives by transfer waits for room at the router, not here: once
it has waited that long, its reservation preempts the same way (Scheduler.reserve, waited_s). Preemption
recomputes: the victims' output does not change.
"""

from __future__ import annotations

import bisect
from collections import deque
import time
from typing import Callable

from tandem.engine.engine_config import SchedulingConfig
from tandem.engine.request import RequestStatus, Sequence


def order_key(policy: str, *, arrival: tuple[int, ...], priority: int, size: tuple[int, ...], tag: float,
              aged: bool = False) -> tuple:
    """A waiter's place in policy's order, lower first (the table above): arrival is (arrival, sample index) in
    the engine, (arrival,) at the router (router/policy_queue.py); size: what sjf compares; tag: fair's start
    tag; aged: sjf's waiter has waited its aging bound."""
    if policy == "priority":
        return (priority, *arrival)
    if policy == "sjf":
        return (0, *arrival) if aged else (1, *size, *arrival)
    if policy == "fair":
        return (tag, *arrival)
    return arrival


ALONE_WINDOW, ALONE_STEPS = 8, 4  # of the last 8 steps, at most 4 compute one prompt alone (shares)


class WaitingQueue(list):
    """The scheduler's waiting sequences, kept in order of their keys (Sequence.order)."""

    def push(self, seq: Sequence) -> None:
        """Inserts seq after every sequence of a key not larger than its own."""
        bisect.insort(self, seq, key=lambda s: s.order)


class StepShares:
    """How many prompt tokens each tenant may still compute this step (left; None: no limit), or the one sequence
    whose prompt the step computes alone (alone: its seq_id; every other prompt waits a step)."""

    def __init__(self, left: dict[str | None, int] | None = None, alone: str | None = None):
        self.left, self.alone = left, alone

    def allow(self, seq: Sequence, budget: int) -> int:
        """What a prompt chunk of seq may take of budget."""
        if self.alone is not None:
            return budget if seq.seq_id == self.alone else 0
        return budget if self.left is None else max(0, min(budget, self.left.get(seq.tenant, budget)))

    def take(self, seq: Sequence, count: int) -> None:
        """seq was scheduled count tokens: a prompt chunk's count against its tenant's share."""
        if self.left is not None and seq.is_prefilling and seq.tenant in self.left:
            self.left[seq.tenant] -= count


NO_SHARES = StepShares()


def weighted_max_min(total: int, demand: dict, weight: Callable[[object], float]) -> dict:
    """total split between demand's keys: each gets at most its demand, and what one does not need goes to the
    others in proportion to their weights (floored to whole tokens)."""
    shares, left, remaining = {}, dict(demand), float(total)
    while left and remaining >= 1:
        weights = sum(weight(k) for k in left)
        fair = {k: remaining * weight(k) / weights for k in left}
        satisfied = [k for k in left if left[k] <= fair[k]]
        if not satisfied:
            shares.update({k: int(fair[k]) for k in left})
            return shares
        for k in satisfied:
            shares[k] = left.pop(k)
            remaining -= shares[k]
    shares.update({k: 0 for k in left})
    return shares


class FairShare:
    """Start-time fair queueing's tags (the module docstring's fair): what the scheduler and the router's prefill
    waiting room order by under the fair policy."""

    def __init__(self, config: SchedulingConfig):
        self.config = config
        self.virtual_time = 0.0  # the largest start tag among those started
        self._finish: dict[str | None, float] = {}  # each tenant's last finish tag

    def tag(self, tenant: str | None, cost: float) -> float:
        """The start tag of tenant's next piece of work of `cost` tokens (which moves the tenant's finish tag)."""
        start = max(self.virtual_time, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + cost / self.config.weight(tenant)
        return start

    def started(self, tag: float) -> None:
        self.virtual_time = max(self.virtual_time, tag)


class SchedulingPolicy:
    def __init__(self, config: SchedulingConfig, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self.fair = FairShare(config)
        self._alone: deque[bool] = deque(maxlen=ALONE_WINDOW)  # whether each of the last steps computed one alone
        self._seen: dict[str | None, float] = {}  # fair_reserve_s: when each tenant last had a sequence here

    def enqueue(self, seq: Sequence, queue: WaitingQueue) -> None:
        """Puts seq into the waiting queue, keyed (the first time) by the policy: see the module docstring."""
        seq.queued_at = self.clock()
        self.assign(seq)
        queue.push(seq)

    def assign(self, seq: Sequence) -> None:
        """Gives seq its key if it has none yet (a sequence that runs without waiting: its KV arrives by transfer)."""
        if not seq.order:
            seq.order = self._key(seq)

    def _key(self, seq: Sequence) -> tuple:
        policy, tag = self.config.policy, 0.0
        if policy == "fair":
            tag = self.fair.tag(seq.tenant, seq.num_prompt_tokens + seq.params.max_tokens * (1 + len(seq.fork_seeds)))
        return order_key(policy, arrival=(seq.arrival, seq.index), priority=seq.priority,
                         size=(seq.num_prompt_tokens, seq.params.max_tokens), tag=tag)

    def started(self, seq: Sequence) -> None:
        """A waiting sequence started running (fair: the virtual time moves to its start tag)."""
        if self.config.policy == "fair" and seq.order:
            self.fair.started(seq.order[0])

    def age(self, queue: WaitingQueue) -> None:
        """sjf: sequences that have waited sjf_aging_s move ahead of every one that has not."""
        if self.config.policy != "sjf":
            return
        deadline = self.clock() - self.config.sjf_aging_s
        aged = [seq for seq in queue if seq.order[0] == 1 and seq.queued_at <= deadline]
        for seq in aged:
            seq.order = order_key("sjf", arrival=(seq.arrival, seq.index), priority=seq.priority, size=(), tag=0.0,
                                  aged=True)
        if aged:
            queue.sort(key=lambda s: s.order)

    def ahead_of(self, running: Sequence, queue: WaitingQueue, budget: int,
                 can_start: Callable[[Sequence], bool]) -> int:
        """sjf: the prompt tokens (at most budget) of the waiting sequences that go before the prompt of `running`
        this step (see the module docstring); 0 under the other policies."""
        if self.config.policy != "sjf" or running.queued_at <= self.clock() - self.config.sjf_aging_s:
            return 0
        ahead = 0
        for seq in queue:  # in key order
            if seq.order >= running.order or ahead >= budget or not can_start(seq):
                break
            ahead += seq.num_tokens - seq.num_computed_tokens
        return min(ahead, budget)

    def shares(self, budget: int, running: list[Sequence], queue: WaitingQueue,
               can_start: Callable[[Sequence], bool]) -> StepShares:
        """fair, with two or more tenants having prompt tokens to compute: each one's share of the step's budget
        after the decodes (weighted max-min over what each needs); else no limit. But when the first waiting
        sequence in fair order can start (can_start: a seat, its adapter) and its tenant has fewer prompt tokens
        to compute than each other tenant, the step computes its prompt alone, as much as the decodes leave room
        for: the light tenant's request starts in short steps of its own rather than in steps that the heavy
        tenant's prompt chunks make long (a step's time grows with its prompt tokens on a CPU, and a new
        request's TTFT is the step under way plus its own). At most ALONE_STEPS of the last ALONE_WINDOW steps
        go to one prompt alone, so that the heavy tenant's prompts advance in the others. With fair_reserve_s, the
        tenants seen within it that have no prompt to compute keep their shares, unused."""
        if self.config.policy != "fair":
            return NO_SHARES
        alone_lately = sum(self._alone)
        self._alone.append(False)
        demand: dict[str | None, int] = {}
        decoding = 0
        for seq in (*running, *queue):
            if (left := seq.num_tokens - seq.num_computed_tokens) > 1 or seq.status is not RequestStatus.RUNNING:
                demand[seq.tenant] = demand.get(seq.tenant, 0) + left
            else:
                decoding += 1
        reserved = self._reserved(running, queue, demand)
        if len(demand) + len(reserved) < 2:
            return NO_SHARES
        if len(demand) >= 2 and alone_lately < ALONE_STEPS and queue and can_start(head := queue[0]) \
                and demand[head.tenant] < min(need for tenant, need in demand.items() if tenant != head.tenant):
            self._alone[-1] = True
            return StepShares(alone=head.seq_id)
        room = max(0, budget - decoding)
        shares = weighted_max_min(room, demand | dict.fromkeys(reserved, room), self.config.weight)
        return StepShares({tenant: shares[tenant] for tenant in demand})

    def _reserved(self, running: list[Sequence], queue: WaitingQueue, demand: dict) -> list:
        """fair_reserve_s: the tenants without a prompt to compute that had a sequence here within it."""
        reserve_s = self.config.fair_reserve_s
        if not reserve_s:
            return []
        now = self.clock()
        for seq in (*running, *queue):
            self._seen[seq.tenant] = now
        for tenant in [t for t, at in self._seen.items() if now - at > reserve_s]:
            del self._seen[tenant]
        return [tenant for tenant in self._seen if tenant not in demand]

    def urgent(self, queue: WaitingQueue, running: list[Sequence]) -> Sequence | None:
        """The waiting sequence that may preempt now (see the module docstring), the best (priority, arrival) of
        those that qualify; None when preemption by priority is off or none qualifies."""
        after = self.config.preempt_after_s
        if after is None or not running or not queue:
            return None
        worst = max(seq.priority for seq in running)
        due = self.clock() - after
        waited = [seq for seq in queue if seq.priority < worst and seq.queued_at <= due]
        return min(waited, key=lambda s: (s.priority, s.arrival, s.index)) if waited else None

    def overdue(self, waited_s: float) -> bool:
        """Whether a request that has waited waited_s for room elsewhere (a reservation: in the router's decode
        room) may preempt running requests of lower priority."""
        return self.config.preempt_after_s is not None and waited_s >= self.config.preempt_after_s

    @staticmethod
    def victims(running: list[Sequence], urgent: Sequence) -> list[Sequence]:
        """The running sequences urgent may preempt, in the order to preempt them: lower priority only, the least
        computed work lost first (then the latest arrival)."""
        lower = [seq for seq in running if seq.priority > urgent.priority]
        return sorted(lower, key=lambda s: (s.num_computed_tokens, -s.arrival))
