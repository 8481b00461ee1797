"""The manifest's `observability` section (cluster/manifest.py): where the router sends request traces."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

from tandem.replica.tracing import TracingConfig


class ObservabilitySettings(BaseModel):
    """otlp_endpoint: an OpenTelemetry collector's OTLP/gRPC address ("http://collector:4317"; "https://" for TLS)
    that gets one trace per request (router/tracing.py, replica/tracing.py); null: no traces, and no tracer is
    created.
    service_name: the traces' service.name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    otlp_endpoint: str | None = None
    service_name: str = "tandem"

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be http://HOST:PORT or https://HOST:PORT, got {endpoint!r}")
        return endpoint

    def tracing(self) -> TracingConfig | None:
        """The router's and the replicas' tracing configuration; None when traces are off."""
        return TracingConfig(self.otlp_endpoint, self.service_name) if self.otlp_endpoint else None
