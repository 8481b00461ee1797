"""Token replay: what the router keeps of a request so that it survives the death of a replica serving it
(DESIGN.md section 2, failure paths). Plain Python, no Ray; router/lifecycle.py drives it.

A decode replica that dies mid-stream (n == 1):
  1. the router has remembered sample 0's tokens it forwarded to the client (Replay.forward);
  2. it picks another decode replica of the pool (the routing's decode ranking; the dead one has left the pool)
     and calls DecodeReplicaAPI.resume there under the key of a new attempt (Replay.next_key: replica id
     f"{...}/{run}.m{k}", run_key.py) with the prompt, the request's params and a ResumeState of those tokens and
     the request's seed;
  3. that replica prefills prompt + delivered tokens and streams from the next token on; the router reports its
     outputs as it reports every replica's (Replay.forward: under the client's id, with the first replica's
     num_cached_tokens, so that usage does not change), and the client's stream goes on with no duplicated or
     missing token.
The continuation equals the uninterrupted run for greedy and seeded sampling because the sampler's draw depends
only on (seed, step): the router gives every n == 1 request a seed before sending it (seeded()), so a replay
draws with the seed the first replica used, from the step after the delivered tokens; penalties and max_tokens
count the delivered tokens as outputs, and the new replica's detokenizer and stop-string matcher are primed with
them (engine/core/resume.py). A replica that dies before any token reached the client is replayed with none (in the
disaggregated path the prefill replica's first token is sampled again, the same for greedy and seeded requests).

A prefill replica that dies mid-prefill: the decode reservation is dropped, and the request is prefilled again on
another prefill replica (a new plan, under the key of a new attempt: f"{...}/{run}.p{k}") or, with none left,
by its decode replica.

Each move (a migration or a prefill retry) counts against DriverSettings.max_migrations; past it, or with no
replica left to move to, the request ends UNAVAILABLE saying why. Requests with n > 1 are never moved: their
samples fork from one prompt on one replica, and a replay would need every sample's tokens and the fork point;
a replica death ends them UNAVAILABLE as before.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.sampling_params import SamplingParams
from tandem.router.run_key import RunKey

# Routing decision reasons (Routing.decisions, the tandem_prefill_decisions metric): a decode replica prefilled
# a migrated request's replay; a prompt was prefilled again after its prefill replica died.
MIGRATION = "migration"
PREFILL_DIED = "prefill_replica_died"


def seeded(params: SamplingParams) -> SamplingParams:
    """params with a random seed when it has none and n == 1, so that a replay after a replica's death can draw
    with the same seed (the engine would otherwise draw one the router never learns). Costs nothing otherwise:
    an unseeded request's output is just as random."""
    if params.seed is not None or params.n != 1:
        return params
    return dataclasses.replace(params, seed=secrets.randbits(63))


@dataclass
class Replay:
    """One request's delivery record, kept by the driver while it runs. key: the request's first attempt (its
    request_id is the client's, what outputs are reported under); moves: migrations and prefill retries so far;
    token_ids: sample 0's tokens forwarded so far; started: a progress has been forwarded (later ones must not
    look like a first one); num_cached_tokens: what the outputs of the replica that first streamed reported
    (None: none streamed)."""

    key: RunKey
    max_moves: int
    moves: int = 0
    token_ids: list[int] = field(default_factory=list)
    started: bool = False
    num_cached_tokens: int | None = None

    @property
    def can_move(self) -> bool:
        return self.moves < self.max_moves

    def next_key(self, kind: str) -> RunKey:
        """Counts one move and returns the key of its attempt (kind "m": a migration, "p": a prefill retry;
        RunKey.moved). Raises ValueError when no move is left (check can_move)."""
        if not self.can_move:
            raise ValueError(f"request {self.key.replica_id()} has no move left ({self.max_moves} allowed)")
        self.moves += 1
        return self.key.moved(kind, self.moves)

    def forward(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A replica's outputs as the client gets them (for_client), with sample 0's tokens recorded as
        delivered."""
        forwarded = [self.for_client(o) for o in outputs]
        for o in forwarded:
            if o.index == 0:
                self.token_ids.extend(o.token_ids)
        return forwarded

    def for_client(self, output: RequestOutput) -> RequestOutput:
        """The one step where a replica's naming ends: output under the client's request id (the replica streamed
        it under its attempt's RunKey.replica_id()) and, after a move, with the num_cached_tokens of the replica
        that first streamed (usage does not change). Records that num_cached_tokens from the first output."""
        cached = output.num_cached_tokens
        if self.num_cached_tokens is None:
            self.num_cached_tokens = cached
        elif self.moves:
            cached = self.num_cached_tokens
        if output.request_id == self.key.request_id and output.num_cached_tokens == cached:
            return output
        # RequestOutput is frozen, and the replica may still hold the object it streamed (an in-process mock
        # does), so the client's copy is a new one; this is the only place an output's id is changed.
        return dataclasses.replace(output, request_id=self.key.request_id, num_cached_tokens=cached)

    def resume_state(self, seed: int | None) -> ResumeState:
        """What a replay continues from: the delivered tokens and the request's seed (seeded() set it)."""
        return ResumeState(tuple(self.token_ids), seed)
