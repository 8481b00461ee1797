"""The request driver's settings (router/lifecycle.py), from the manifest's router section."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.engine_config import SchedulingConfig
from tandem.router.routing import RoutingSettings


@dataclass(frozen=True)
class DriverSettings:
    """max_migrations: how many times one request may move to another replica after one serving it died (a
    decode replica mid-stream: token replay; a prefill replica mid-prefill: prefill again); 0 ends it
    UNAVAILABLE at the first death."""

    mode: str = "disaggregated"
    max_queued_requests: int = 256
    queue_timeout_s: float = 30.0
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    kv_events_interval_s: float = 0.05  # how often the router polls every replica's KV events and load
    max_migrations: int = 3
    prefill_queue_tokens: int = 0  # late binding: prefill_waiting_room.py (0: off)
    waiting_room: SchedulingConfig = SchedulingConfig()  # the order it wakes requests in: the prefill pool's policy
    decode_room: SchedulingConfig = SchedulingConfig()  # the order requests wait for decode room: the decode pool's
    # LoRA adapters loaded and unloaded over HTTP while serving (lora_routes.py), by these tenants when keys are on
    lora_runtime_loading: bool = False
    lora_admin_tenants: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be at least 0, got {self.max_migrations}")
        if self.prefill_queue_tokens < 0:
            raise ValueError(f"prefill_queue_tokens must be at least 0, got {self.prefill_queue_tokens}")
