"""What the fuzz of tests/cluster/test_api_fuzz.py sends, as data: the raw HTTP requests and gRPC calls, the
names every part draws from, and examples(), which draws a strategy's values the same way every run. The
strategies are tests/cluster/fuzz_strategies.py's (HTTP, and drawing each part) and fuzz_grpc.py's."""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
ROUTES = ("/v1/chat/completions", "/v1/completions")
WORDS = ["Hello", "the sea", "What is 2+2?", "Name a color.", "Once upon a time", "héllo wörld", "日本語", "🙂"]


@dataclass(frozen=True)
class RawHttp:
    """One raw request. close: "read" (read the reply to EOF), "half" (shut our side after sending, then read:
    a body cut short) or "abort" (reset the connection after sending; no reply). api: it reaches an OpenAI
    route with well-formed framing, so a 4xx must carry OpenAI's error object. timeout_s: the `timeout` the
    body asks for (a 504 is then the answer it asked for), if any."""

    kind: str
    data: bytes
    close: str = "read"
    api: bool = True
    timeout_s: float | None = None


@dataclass(frozen=True)
class RawGrpc:
    kind: str
    method: str
    data: bytes


def examples(strategy: st.SearchStrategy, count: int) -> list:
    """count values of strategy (fewer only if it has fewer), the same ones every run."""
    out: list = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value):
        out.append(value)

    collect()
    return out
