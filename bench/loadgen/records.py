"""The load generator's seams: what one request asks (WorkRequest), the clock it is paced and timed by (Clock),
what sends it (Backend), and what its run left behind, as a JSONL row (RequestRecord). Times are seconds since the run's start
(the pacer's clock, time.perf_counter based), so that a record says when the request was due (scheduled_s), when
it went out (sent_s) and when each streamed message with tokens came back.

Latencies are measured from scheduled_s, never from sent_s: a request that went out late because the sender fell
behind still counts its lateness (no coordinated omission)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class WorkRequest:
    """One call to the server. Exactly one of prompt_ids (token ids of the served model's tokenizer; an OpenAI
    backend sends their text), text (a raw prompt) or messages (a chat) is set. klass: the workload's class of
    request ("short", "long", "turn", "trace", ...). Greedy and ignore_eos by default, so that every request
    generates exactly max_tokens tokens and runs are comparable."""

    max_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs
    klass: str = "request"
    session_id: str | None = None
    turn: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True


class Clock(Protocol):
    """Seconds since the run started. The real one wraps time.perf_counter; tests use a fake one."""

    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None:
        """Returns at (or, never early, after) time t; at once when t has passed."""


class Backend(Protocol):
    """Sends requests to one server and times them."""

    name: str

    async def send(self, request: WorkRequest, record: RequestRecord, clock: Clock) -> str:
        """Sends request now and fills record as it streams: sent_s (clock.now() as it goes out), on_tokens() per
        message with tokens, end_s, prompt/cached/output tokens from the server's usage, server_timings; on a
        failure record.fail(kind, message) instead of raising. Returns the generated text (a session's next turn
        carries it)."""

    async def aclose(self) -> None: ...


@dataclass
class RequestRecord:
    """index: the request's place in the schedule. klass: the workload's class of request ("short", "long",
    "turn", "trace", ...), for per-class breakdowns. token_times_s / token_counts: each streamed message that
    carried output tokens, when it arrived and how many tokens it carried (a message may carry several).
    output_tokens: as the server's usage says (else the tokens counted in the stream). cached_tokens: prompt tokens
    the server served from its prefix cache (None when it does not say). error: the kind of failure (a gRPC status
    name such as "UNAVAILABLE", "http_429", "timeout", "connection", "incomplete"), None on success.
    server_timings: what the server reported (tandem: ttft_s, mean_itl_s, e2e_s, queue_s, prefill_s)."""

    index: int
    scheduled_s: float
    klass: str = "request"
    session_id: str | None = None
    turn: int = 0
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    output_tokens: int = 0
    max_tokens: int = 0
    error: str | None = None
    error_message: str = ""
    server_timings: dict[str, float] = field(default_factory=dict)

    def on_tokens(self, now_s: float, count: int) -> None:
        """A streamed message with count output tokens arrived at now_s."""
        if count <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.token_times_s.append(now_s)
        self.token_counts.append(count)

    def fail(self, kind: str, message: str = "") -> None:
        self.error, self.error_message = kind, message[:500]

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> RequestRecord:
        """Raises ValueError naming an unknown field (a file written by another tool)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(row) - names):
            raise ValueError(f"not a tandem bench record: unknown field(s) {', '.join(unknown)}")
        return cls(**row)
