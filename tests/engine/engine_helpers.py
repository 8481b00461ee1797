"""Running LLMEngine to completion in tests, and the tiny random model the fast engine tests use."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.core.output_processor import RequestOutput


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    num_cached_tokens: int = 0


def collect(outputs: list[RequestOutput], into: dict) -> None:
    for out in outputs:
        c = into[(out.request_id, out.index)]
        c.token_ids.extend(out.token_ids)
        c.text += out.text
        c.num_cached_tokens = out.num_cached_tokens
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        if out.finish_reason:
            c.finish_reason = out.finish_reason


def run_all(engine: LLMEngine, max_steps: int = 100_000, check: bool = True) -> dict[tuple[str, int], Completion]:
    """Steps until idle; returns {(request id, sample index): Completion}."""
    done: dict = defaultdict(Completion)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        collect(engine.step(), done)
        if check:
            engine.check_integrity()
    assert not engine.has_unfinished_requests()
    return dict(done)
