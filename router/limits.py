"""What one request and one tenant may ask of the router, as the manifest states it (`router.limits`,
`auth.tenants`), and the checks that hold them before any work is done. Plain pydantic: the manifest
(cluster/manifest.py) uses these models as its own fields, and the router takes them from there.

RequestLimits bounds everything a client controls the size of: the body, the prompt (characters before it is
tokenized, tokens after), n, max_tokens, stop strings, logprobs, a completions prompt list, chat messages and
the nesting depth of the JSON. A value left null follows the model (max_model_len). TenantLimits clamps a
tenant's priority, caps its requests in flight and queued, limits its rates and weighs its fair share.
AdmissionSettings says when the cluster as a whole is too busy to start a new request in time
(router/admission.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(value: Any) -> int:
    """An int, or a string like '256MiB' / '1.5 GB'. Raises ValueError naming the accepted units."""
    import re

    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like 268435456, '256MiB' or '1GB', got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestLimits(_Strict):
    """Each is refused with HTTP 400 (413 for the body) / gRPC INVALID_ARGUMENT before any work is done.
    max_body_bytes also bounds a gRPC message (grpc.max_receive_message_length). body_timeout_s: how long a
    client may take to send its HTTP request's headers (from its first byte, or from the connection's opening:
    the connection is then closed with 408) and then its body (408 past it). max_connections_per_client: open
    HTTP connections from one client address; more get 429 and are closed (router/http_connections.py).
    max_prompt_chars: text and
    chat content, counted before tokenizing (null: 16 characters per token of max_prompt_tokens).
    max_prompt_tokens, max_tokens: null is the model's max_model_len. parse_threads: the router's threads that
    tokenize prompts and render chat templates, off its event loop."""

    max_body_bytes: int = Field(4 << 20, ge=1024)
    body_timeout_s: float = Field(30.0, gt=0)
    max_connections_per_client: int = Field(1024, ge=1)
    max_json_depth: int = Field(32, ge=4, le=1000)
    max_prompt_chars: int | None = Field(None, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_n: int = Field(8, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_string_chars: int = Field(256, ge=1)
    max_stop_token_ids: int = Field(64, ge=0)
    max_top_logprobs: int = Field(20, ge=0)
    max_batch_prompts: int = Field(32, ge=1)
    max_messages: int = Field(256, ge=1)
    parse_threads: int = Field(2, ge=1, le=64)

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return parse_bytes(value)

    def prompt_tokens(self, max_model_len: int) -> int:
        return min(self.max_prompt_tokens or max_model_len, max_model_len)

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or 16 * self.prompt_tokens(max_model_len)

    def completion_tokens(self, max_model_len: int) -> int:
        return min(self.max_tokens or max_model_len, max_model_len)


class PriorityRange(_Strict):
    """A tenant's priorities (lower runs first): what a client sends is clamped into [min, max]; a request that
    sends none runs at `default` (null: 0 clamped into the range)."""

    min: int = Field(0, ge=-2**31, le=2**31 - 1)
    max: int = Field(0, ge=-2**31, le=2**31 - 1)
    default: int | None = Field(None, ge=-2**31, le=2**31 - 1)

    @model_validator(mode="after")
    def _order(self) -> PriorityRange:
        if self.min > self.max:
            raise ValueError(f"priority min ({self.min}) is more than max ({self.max})")
        if self.default is not None and not self.min <= self.default <= self.max:
            raise ValueError(f"priority default ({self.default}) must lie between min ({self.min}) and "
                             f"max ({self.max})")
        return self

    def clamp(self, asked: int | None) -> int:
        """The priority a request runs at: asked (None or 0: not asked) clamped into the range."""
        if not asked:
            return self.default if self.default is not None else min(max(0, self.min), self.max)
        return min(max(asked, self.min), self.max)


class TenantLimits(_Strict):
    """priority: the range the tenant's requests may ask for. max_requests: its requests in flight and queued
    at once (null: no cap); past it a request is refused with HTTP 429 + Retry-After / RESOURCE_EXHAUSTED.
    requests_per_minute, tokens_per_minute (prompt and generated tokens): its rate limits (null: none;
    router/rate_limits.py), refused the same way. weight: its share against other tenants where a pool
    schedules `fair` (a tenant of weight 2 gets twice the tokens of one of weight 1 while both wait)."""

    priority: PriorityRange = PriorityRange()
    max_requests: int | None = Field(None, ge=1)
    retry_after_s: int = Field(1, ge=1, le=3600)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    weight: float = Field(1.0, gt=0, le=1e6)


class AdmissionSettings(_Strict):
    """When a new request is refused at once because it would not start (first token) in time
    (router/admission.py). mode: "queue_timeout" refuses a request expected to start later than the router's
    queue_timeout_s, "slo" one expected to start later than ttft_slo_s (the manifest's slo.ttft_s; required in
    that mode). window_s: how far back the cluster's start rate is measured. initial_waiting: how many requests
    may wait to start before any start rate has been measured."""

    mode: Literal["queue_timeout", "slo"] = "queue_timeout"
    ttft_slo_s: float | None = Field(None, gt=0)
    window_s: float = Field(20.0, gt=0)
    initial_waiting: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _slo_has_target(self) -> AdmissionSettings:
        if self.mode == "slo" and self.ttft_slo_s is None:
            raise ValueError("admission mode 'slo' needs a TTFT SLO: set slo.ttft_s, or router.admission: "
                             "queue_timeout")
        return self


class ServingLimits(_Strict):
    """Everything the router's front doors hold requests to (the controller builds it from the manifest's router,
    auth and slo sections). request_timeout_s: every request's deadline; a client may ask for less. admission:
    when the cluster refuses a request it cannot start in time."""

    request_timeout_s: float = Field(600.0, gt=0)
    admission: AdmissionSettings = AdmissionSettings()
    limits: RequestLimits = RequestLimits()
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    default_tenant: TenantLimits = TenantLimits()

    def tenant(self, name: str | None) -> TenantLimits:
        """The limits of tenant `name` (None: authentication is off)."""
        return self.tenants.get(name, self.default_tenant) if name is not None else self.default_tenant
