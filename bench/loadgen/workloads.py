"""What each request asks: prompts of chosen lengths in tokens of the served model's tokenizer, built from one
seed so that a workload is the same on every run and against every server.

    synthetic      prompts and outputs drawn from length distributions (--input, --output)
    shared-prefix  --prefix-groups groups; each request is its group's --prefix-len tokens plus its own prompt
    long-mix       a --long-share of requests with --long-input prompts among short chats (classes long/short)
    sessions       multi-turn chats: --turns user messages, each sent --think-time s after the previous answer,
                   with the conversation so far and a session_id
    trace          a JSONL trace's requests at its timestamps (see read_trace)

Length distributions are written `fixed:256`, `uniform:128,512` (inclusive bounds) or `lognormal:256,0.5`
(median 256 tokens, sigma 0.5 of the underlying normal), parsed by parse_length.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from tandem.bench.loadgen.records import WorkRequest

WORKLOADS = ("synthetic", "shared-prefix", "long-mix", "sessions", "trace")
# Token ids drawn for synthetic text stay clear of the vocabulary's first ids (special and byte tokens).
_FIRST_ID = 1000


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(self.a * math.exp(rng.gauss(0.0, self.b))))

    def __str__(self) -> str:
        return f"fixed:{int(self.a)}" if self.kind == "fixed" else \
            f"uniform:{int(self.a)},{int(self.b)}" if self.kind == "uniform" else f"lognormal:{int(self.a)},{self.b:g}"


def parse_length(text: str) -> LengthDist:
    """`fixed:N`, `uniform:LO,HI`, `lognormal:MEDIAN,SIGMA` (a bare `N` is fixed:N). Raises ValueError saying
    which form was expected."""
    kind, _, rest = text.partition(":") if ":" in text else ("fixed", "", text)
    try:
        values = [float(v) for v in rest.split(",")]
    except ValueError:
        raise ValueError(f"bad length distribution {text!r}: expected fixed:N, uniform:LO,HI or "
                         f"lognormal:MEDIAN,SIGMA") from None
    shapes = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if kind not in shapes or len(values) != shapes[kind]:
        raise ValueError(f"bad length distribution {text!r}: expected fixed:N, uniform:LO,HI or "
                         f"lognormal:MEDIAN,SIGMA")
    if values[0] < 1 or (kind == "uniform" and values[1] < values[0]) or (kind == "lognormal" and values[1] < 0):
        raise ValueError(f"bad length distribution {text!r}: lengths are at least 1 token, uniform needs LO <= HI, "
                         f"lognormal a non-negative sigma")
    return LengthDist(kind, *values)


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that decides the requests (not when they are sent)."""

    kind: str = "synthetic"
    input: LengthDist = LengthDist("fixed", 256)
    output: LengthDist = LengthDist("fixed", 64)
    prefix_groups: int = 4
    prefix_len: int = 512
    long_share: float = 0.1
    long_input: LengthDist = LengthDist("fixed", 3000)
    turns: int = 3
    think_time_s: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose one of {', '.join(WORKLOADS)}")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"--long-share is a fraction between 0 and 1, got {self.long_share}")
        if self.prefix_groups < 1 or self.turns < 1:
            raise ValueError("--prefix-groups and --turns must be at least 1")


@dataclass(frozen=True)
class Conversation:
    """One arrival: a single request, or a session's turns. at_s: when its first request is due (seconds after
    the start; None in closed loop). A session's later turns are due think_s after the previous answer ends;
    each turn's messages hold only that turn's user message (the runner adds the history)."""

    at_s: float | None
    requests: tuple[WorkRequest, ...]
    think_s: float = 0.0


class PromptMaker:
    """Token ids (and their text) of given lengths, from the served model's tokenizer (engine Tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int):
        if vocab_size <= 2 * _FIRST_ID:
            raise ValueError(f"a vocabulary of {vocab_size} tokens is too small for synthetic prompts")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def ids(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(_FIRST_ID, self.vocab_size) for _ in range(n))

    def text(self, rng: random.Random, n: int) -> str:
        """Text of about n tokens: decoded random ids, re-encoded once and cut to n (decoding then encoding
        merges some tokens, as vLLM's random dataset also finds)."""
        ids = list(self.ids(rng, n))
        again = self.tokenizer.encode(self.tokenizer.decode(ids))
        if len(again) < n:
            again += list(self.ids(rng, n - len(again)))
        return self.tokenizer.decode(again[:n])


def build(config: WorkloadConfig, maker: PromptMaker, offsets: Sequence[float | None]) -> list[Conversation]:
    """One Conversation per offset (the arrival process's due times; None entries for closed loop). Raises
    ValueError for the trace workload (read_trace builds those)."""
    rng = random.Random(config.seed)
    if config.kind == "trace":
        raise ValueError("the trace workload takes its requests and times from the trace (read_trace)")
    prefixes = [maker.ids(rng, config.prefix_len) for _ in range(config.prefix_groups)] \
        if config.kind == "shared-prefix" else []
    out = []
    for i, at in enumerate(offsets):
        max_tokens = config.output.sample(rng)
        if config.kind == "sessions":
            turns = tuple(WorkRequest(config.output.sample(rng), messages=(("user", maker.text(rng, config.input.sample(rng))),),
                                      klass="turn", session_id=f"session-{config.seed}-{i}", turn=t)
                          for t in range(config.turns))
            out.append(Conversation(at, turns, config.think_time_s))
            continue
        if config.kind == "long-mix" and rng.random() < config.long_share:
            request = WorkRequest(max_tokens, prompt_ids=maker.ids(rng, config.long_input.sample(rng)), klass="long")
        elif config.kind == "long-mix":
            request = WorkRequest(max_tokens, prompt_ids=maker.ids(rng, config.input.sample(rng)), klass="short")
        elif config.kind == "shared-prefix":
            group = rng.randrange(config.prefix_groups)
            request = WorkRequest(max_tokens, prompt_ids=prefixes[group] + maker.ids(rng, config.input.sample(rng)),
                                  klass=f"group-{group}")
        else:
            request = WorkRequest(max_tokens, prompt_ids=maker.ids(rng, config.input.sample(rng)))
        out.append(Conversation(at, (request,)))
    return out


def read_trace(path: str | Path, maker: PromptMaker, *, time_unit: str = "s", speedup: float = 1.0,
               block_tokens: int = 512, seed: int = 0) -> list[Conversation]:
    """A JSONL trace, one request per line: `timestamp` (in time_unit, "s" or "ms", from any origin; Mooncake's
    traces use ms), the prompt as `prompt` (text) or `input_length` (tokens; with `hash_ids`, Mooncake's list of
    block ids, each id standing for the same block_tokens tokens wherever it appears, so shared ids are shared
    prefixes), `output_length` (or `max_tokens`), and optionally `session_id` and `klass`. Requests are due at
    their timestamps minus the first one, divided by speedup. Raises ValueError naming the line of a bad row."""
    if time_unit not in ("s", "ms") or not speedup > 0:
        raise ValueError("--trace-time-unit is s or ms, and --trace-speedup must be positive")
    scale = (1e-3 if time_unit == "ms" else 1.0) / speedup
    rng = random.Random(seed)
    blocks: dict[int, tuple[int, ...]] = {}
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            at = float(row["timestamp"])
            max_tokens = int(row.get("output_length", row.get("max_tokens")))
            if "prompt" in row:
                request = WorkRequest(max_tokens, text=str(row["prompt"]))
            else:
                length = int(row["input_length"])
                ids: tuple[int, ...] = ()
                for block in row.get("hash_ids", []):
                    ids += blocks.setdefault(int(block), maker.ids(rng, block_tokens))
                ids = ids[:length] + maker.ids(rng, max(0, length - len(ids)))
                request = WorkRequest(max_tokens, prompt_ids=ids)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: a trace row needs timestamp, input_length or prompt, and output_length "
                             f"({type(e).__name__}: {e})") from None
        if max_tokens < 1:
            raise ValueError(f"{path}:{n}: output_length must be at least 1")
        rows.append((at, replace(request, klass=str(row.get("klass", "trace")), session_id=row.get("session_id"))))
    if not rows:
        raise ValueError(f"{path}: the trace holds no requests")
    start = min(at for at, _ in rows)
    return [Conversation((at - start) * scale, (request,)) for at, request in sorted(rows, key=lambda r: r[0])]
