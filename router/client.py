"""A Python client of tandem's gRPC API (proto/v1/tandem.proto): streamed generation, abort, models, health.

    from tandem.router.client import TandemClient
    with TandemClient("127.0.0.1:50051") as client:
        for chunk in client.stream(chat=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.text, end="", flush=True)
        result = client.generate(prompt="The capital of France is", max_tokens=8, temperature=0)

A cluster with `tls:` in its manifest serves TLS only: TandemClient("HOST:PORT", tls_ca="ca.pem") trusts the CA
that signed its certificate (for a self-signed one, the certificate itself); the certificate must name HOST.

Errors arrive as grpc.RpcError (e.code(), e.details()). A channel whose router went away (the control plane
replaces a dead router on the same address within seconds) tries to reconnect at least every
MAX_RECONNECT_BACKOFF_MS, not gRPC's default of up to two minutes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc

# gRPC's reconnect backoff grows from 1 s to 120 s, and channels to one address share it (its subchannel pool): a
# client that kept calling while the router was replaced would wait out the backoff long after the new one serves.
MAX_RECONNECT_BACKOFF_MS = 1000
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS))
_SAMPLING = tuple(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)


class TokenClock:
    """Client-side TTFT and inter-token gaps: call tick(has_tokens) as each message arrives."""

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self.ttft_s: float | None = None
        self.gaps_s: list[float] = []

    def tick(self, has_tokens: bool) -> None:
        now = time.perf_counter()
        if not has_tokens:
            return
        if self.ttft_s is None:
            self.ttft_s = now - self.start
        else:
            self.gaps_s.append(now - self._last)
        self._last = now

    @property
    def mean_itl_s(self) -> float:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else 0.0


@dataclass
class Completion:
    """One request's result, gathered from its stream. texts/token_ids: per sample index. ttft_s / itl_s are
    measured by this client (first and later message arrivals); usage and timings are the server's."""

    request_id: str = ""
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None
    prefill_replica: str = ""
    decode_replica: str = ""
    prefill_route: str = ""  # "prefill_pool", or why the decode replica prefilled ("short_prompt", ...)
    num_messages: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    @property
    def finish_reason(self) -> str:
        return self.finish_reasons.get(0, "")


def build_request(*, prompt: str | None = None, chat: Sequence[Mapping[str, str]] | None = None,
                  token_ids: Sequence[int] | None = None, request_id: str = "", model: str = "", priority: int = 0,
                  **sampling) -> pb.GenerateRequest:
    """Exactly one of prompt / chat / token_ids (none gives a request the server refuses). sampling: the fields
    of SamplingParams (n, max_tokens, temperature, top_p, top_k, min_p, penalties, seed, ignore_eos,
    stop_token_ids, stop, logprobs, speculative_tokens)."""
    unknown = set(sampling) - set(_SAMPLING)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    request = pb.GenerateRequest(request_id=request_id, model=model, priority=priority,
                                 sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    if prompt is not None:
        request.text = prompt
    elif chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat)
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


def _pem(source: str | bytes) -> bytes:
    """PEM bytes as given, or read from the file a str names."""
    return source if isinstance(source, bytes) else Path(source).expanduser().read_bytes()


def channel_credentials(tls_ca: str | bytes,
                        tls_cert: tuple[str | bytes, str | bytes] | None = None) -> grpc.ChannelCredentials:
    """TLS credentials trusting tls_ca (a PEM file's path, or PEM bytes); tls_cert: (certificate chain, private
    key), files or PEM bytes, presented to a cluster that requires client certificates (mutual TLS). Raises
    OSError for a file that cannot be read."""
    chain, key = (None, None) if tls_cert is None else (_pem(tls_cert[0]), _pem(tls_cert[1]))
    return grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca), private_key=key, certificate_chain=chain)


class TandemClient:
    def __init__(self, target: str, *, timeout_s: float | None = None, api_key: str | None = None,
                 tls_ca: str | bytes | None = None, tls_cert: tuple[str | bytes, str | bytes] | None = None):
        """api_key: sent as `authorization: Bearer KEY` on every Tandem call (clusters with API keys on). tls_ca:
        connect over TLS, trusting this CA (a PEM file's path, or PEM bytes); None: plaintext. tls_cert: see
        channel_credentials (needs tls_ca). Raises OSError for a TLS file that cannot be read."""
        if tls_cert is not None and tls_ca is None:
            raise ValueError("tls_cert needs tls_ca: a client certificate is only sent over TLS")
        self.target = target
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.channel = (grpc.insecure_channel(target, CHANNEL_OPTIONS) if tls_ca is None
                        else grpc.secure_channel(target, channel_credentials(tls_ca, tls_cert), CHANNEL_OPTIONS))
        self.stub = pb_grpc.TandemStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Yields the server's messages as they arrive (see build_request for the arguments). Breaking out of the
        loop cancels the call, which aborts the request on the cluster."""
        call = self.stub.Generate(build_request(**kwargs), timeout=self.timeout_s, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def generate(self, **kwargs) -> Completion:
        """The whole completion (see build_request). Raises grpc.RpcError on a failed request."""
        result = Completion()
        clock = TokenClock()
        for message in self.stream(**kwargs):
            clock.tick(bool(message.token_ids))
            result.num_messages += 1
            result.request_id = message.request_id
            i = message.index
            result.texts[i] = result.texts.get(i, "") + message.text
            result.token_ids.setdefault(i, []).extend(message.token_ids)
            result.logprobs.setdefault(i, []).extend(message.logprobs)
            if message.finish_reason:
                result.finish_reasons[i] = message.finish_reason
            if message.prefill_replica or message.decode_replica:
                result.prefill_replica, result.decode_replica = message.prefill_replica, message.decode_replica
                result.prefill_route = message.prefill_route
            if message.HasField("usage"):
                result.usage, result.timings = message.usage, message.timings
        result.ttft_s, result.itl_s = clock.ttft_s or 0.0, clock.gaps_s
        return result

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout_s or 10,
                               metadata=self.metadata).found

    def list_models(self) -> list[pb.Model]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s or 10,
                                         metadata=self.metadata).models)

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... as the standard grpc.health.v1 service reports it."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s or 10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
