"""The cluster manifest: one YAML file that says what `tandem up` starts, and its schema. The file is parsed
once (manifest_yaml.py) into the frozen pydantic models here; every later layer reads these objects, never the
YAML.

    model: embedded                 # or a Hugging Face folder / .gguf file (relative paths: from where tandem runs)
    mode: disaggregated             # or colocated (the decode pool's replicas prefill for themselves)
    ray: {address: null, host: 127.0.0.1}   # address: "auto" (under `ray up`), "HOST:PORT", or null: local
                                    # (started if absent, listening on host)
    pools:
      prefill:
        parallelism: {tp: 2, pp: 1, ep: 1}
        resources: {cpus: 0.5, gpus: 0, custom: {prefill: 1}}    # per rank
        replicas: {min: 1, max: 1, initial: 1}
        engine: {block_size: 16, kv_cache_bytes: 256MiB, max_num_batched_tokens: 2048, max_num_seqs: 128,
                 device: auto, dtype: null,   # auto: CUDA when the ranks ask for GPUs; null: bfloat16 on CUDA
                 speculative: null,           # or {proposer: suffix, max_tokens: 4} (ngram, suffix or draft)
                 kv_tiers: null}              # or {host_bytes: 8GiB, disk_path: /var/tmp/tandem, disk_bytes: 64GiB}
                                    # every key of engine/engine_config.py EngineConfig (cluster/engine_settings.py)
        scheduler: {policy: priority, preempt_after_s: null, sjf_aging_s: 30,   # or fcfs, sjf, fair (tenant weights)
                    fair_reserve_s: 0}  # fair: seconds a tenant keeps its share of a step while it has no prompt
        cpu_affinity: null          # or host CPUs, [0, 1] or "0-3,8": rank r pins to the r-th equal share
        autoscaling: {interval_s: 1, up_window_s: 10, down_window_s: 60, target_utilization: 0.8,
                      down_utilization: 0.5, panic_window_s: 3, panic_pressure: 2, kv_high: 0.8,
                      drain_timeout_s: 300, resource_timeout_s: 300}
      decode: ...
    slo: {ttft_s: null, itl_s: null}  # what the autoscaler sizes the pools for (prefill: TTFT; decode: ITL)
    router:
      policy: cache_aware           # or least_loaded, round_robin, random
      weights: {prefix_tokens: 1, queued_prefill_tokens: 0.5, prefill_in_flight: 8,
                free_blocks: 1, decode_in_flight: 16}
      local_prefill_max_tokens: 0   # prefill on the decode replica below this many uncached tokens (0: never)
      prefill_saturation_tokens: 0  # ... or when every prefill replica has this many queued (0: never)
      session_affinity: false
      max_queued_requests: 256
      queue_timeout_s: 30
      max_migrations: 3             # moves of one request to another replica after a replica serving it died
      prefill_queue_tokens: 0       # late binding: wait at the router while the prefill replica has this many queued
      prefix_pull_min_blocks: 4     # pull a prefix from a replica holding it if that saves this many blocks (0: off)
      request_timeout_s: 600        # every request's deadline (a client may ask for less: gRPC deadline, `timeout`)
      limits: {max_body_bytes: 4MiB, max_n: 8, max_batch_prompts: 32, ...}   # router/limits.py RequestLimits
    transport: {kind: ucx, host: null, lease_s: 30}
    listen: {grpc: 127.0.0.1:50051, http: 127.0.0.1:8000}   # http: null serves gRPC only
    auth:                           # absent or no keys: no authentication
      api_keys:
        - {tenant: acme, key_env: ACME_API_KEY}    # or key: "...", or key_file: path/to/file
      tenants:                      # per tenant (router/limits.py TenantLimits); others get default_tenant
        acme: {priority: {min: -5, max: 5}, max_requests: 64, requests_per_minute: 600,
               tokens_per_minute: 200000, weight: 2}   # rate limits (null: none); weight: its `fair` share
      default_tenant: {priority: {min: 0, max: 0}, max_requests: null}
    tls: {cert_file: server.pem, key_file: server.key, client_ca_file: null,   # absent: plaintext
          ca_file: null}            # what `tandem up --ask` trusts (default: cert_file, for a self-signed one)
    observability: {otlp_endpoint: null, service_name: tandem}   # a trace per request to an OpenTelemetry collector
Structural checks (types, unknown keys, ranges) are pydantic's, in the models below; manifest_yaml.py reads the
file and reports each error with its YAML path, line and a hint; check_manifest() (manifest_checks.py) adds the
checks that need the world outside the file (the model's shape, free ports).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tandem.cluster.autoscaling import ScalingSettings
from tandem.cluster.engine_settings import EngineSettings, SchedulerSettings
from tandem.cluster.lora_settings import LoRASettings
from tandem.cluster.observability_settings import ObservabilitySettings
from tandem.engine.hardware.cpu_affinity import format_cpus, parse_cpu_list
from tandem.engine.hardware.device import default_dtype, planned_device
from tandem.router.limits import RequestLimits, TenantLimits, parse_bytes
from tandem.router.tls import TLSConfig

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Parallelism(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep


class Resources(_Strict):
    """What each rank of a replica asks Ray for. custom: Ray custom resources (e.g. {prefill: 1}), which pin a
    pool to the nodes that offer them."""

    cpus: float = Field(1.0, ge=0)
    gpus: float = Field(0.0, ge=0)
    custom: dict[str, float] = Field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        """One placement-group bundle (Ray's resource names)."""
        bundle = {"CPU": self.cpus, "GPU": self.gpus} | dict(self.custom)
        return {k: v for k, v in bundle.items() if v > 0}


class Replicas(_Strict):
    min: int = Field(1, ge=0)
    max: int = Field(1, ge=1)
    initial: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _order(self) -> Replicas:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is more than max ({self.max})")
        if self.initial is not None and not self.min <= self.initial <= self.max:
            raise ValueError(f"initial ({self.initial}) must lie between min ({self.min}) and max ({self.max})")
        return self

    @property
    def start(self) -> int:
        return self.initial if self.initial is not None else max(self.min, 1)


class AutoscalingSettings(_Strict):
    """How a pool's replica count follows its load between replicas.min and max (cluster/autoscaling.py says
    what each setting does). drain_timeout_s: how long a replica leaving the pool may take to finish its requests
    before it is stopped and they continue elsewhere by replay. resource_timeout_s: how long a new replica may
    wait for Ray to find room for it (Ray's autoscaler is asked for the resources meanwhile) before the pool
    reports the shortfall and stops asking for more until the cluster grows."""

    interval_s: float = Field(1.0, gt=0)
    up_window_s: float = Field(10.0, gt=0)
    down_window_s: float = Field(60.0, gt=0)
    target_utilization: float = Field(0.8, gt=0, le=1)
    down_utilization: float = Field(0.5, gt=0, lt=1)
    panic_window_s: float = Field(3.0, gt=0)
    panic_pressure: float = Field(2.0, gt=1)
    kv_high: float = Field(0.8, gt=0, le=1)
    drain_timeout_s: float = Field(300.0, gt=0)
    resource_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSettings:
        self.policy()  # raises ValueError with what is inconsistent
        return self

    def policy(self) -> ScalingSettings:
        return ScalingSettings(interval_s=self.interval_s, up_window_s=self.up_window_s,
                               down_window_s=self.down_window_s, target_utilization=self.target_utilization,
                               down_utilization=self.down_utilization, panic_window_s=self.panic_window_s,
                               panic_pressure=self.panic_pressure)


class SLOSettings(_Strict):
    """The latency targets the autoscaler sizes the pools for: ttft_s (arrival to first token, the prefill
    pool's and a colocated pool's), itl_s (between tokens, the decode pool's). None: that pool scales on its
    queue and KV margins alone."""

    ttft_s: float | None = Field(None, gt=0)
    itl_s: float | None = Field(None, gt=0)


class Pool(_Strict):
    """One pool of replicas. cpu_affinity: the host CPUs each replica's processes are pinned to (None: no
    pinning), given as a list ([0, 1]) or a Linux cpulist string ("0-3,8") and kept as a sorted tuple of unique
    CPU numbers. A replica's ranks split the list evenly in rank order: rank r gets the r-th contiguous share, so
    its length must be a multiple of the replica's world size (tp x pp x ep). The replica's driver (its actor
    process) is pinned to the whole list. Every replica of the pool on a node takes the same CPUs, so replicas
    that share a node share them (engine/hardware/cpu_affinity.py)."""

    parallelism: Parallelism = Parallelism()
    resources: Resources = Resources()
    replicas: Replicas = Replicas()
    engine: EngineSettings = EngineSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    cpu_affinity: tuple[int, ...] | None = None  # after parallelism: its check reads the world size
    autoscaling: AutoscalingSettings = AutoscalingSettings()

    @field_validator("cpu_affinity", mode="before")
    @classmethod
    def _cpu_list(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        cpus = parse_cpu_list(value)
        parallelism = info.data.get("parallelism")  # absent when it is invalid itself: pydantic says so there
        if parallelism is not None and len(cpus) % (ranks := parallelism.world_size):
            raise ValueError(f"{len(cpus)} CPU(s) ({format_cpus(cpus)}) do not split evenly over a replica's "
                             f"{ranks} ranks (tp x pp x ep): list a multiple of {ranks} CPUs, the same number for "
                             "each rank")
        return cpus

    @property
    def device(self) -> str:
        """The device the pool's ranks compute on, as the manifest says (engine/hardware/device.py planned_device)."""
        return planned_device(self.engine.device, self.resources.gpus)

    @property
    def dtype(self) -> str:
        if self.engine.dtype is None and self.engine.weights != "dense":
            return "bfloat16"
        return self.engine.dtype or default_dtype(self.device)


class Pools(_Strict):
    prefill: Pool | None = None
    decode: Pool


class RoutingWeightsSettings(_Strict):
    """cache_aware's weights (router/policy.py RoutingWeights): prefill costs in tokens, decode scores in blocks."""

    prefix_tokens: float = Field(1.0, ge=0)
    queued_prefill_tokens: float = Field(0.5, ge=0)
    prefill_in_flight: float = Field(8.0, ge=0)
    free_blocks: float = Field(1.0, ge=0)
    decode_in_flight: float = Field(16.0, ge=0)


class RouterSettings(_Strict):
    """policy: how replicas are ranked (router/policy.py). local_prefill_max_tokens / prefill_saturation_tokens:
    conditional disaggregation (router/routing.py; 0 turns each off). session_affinity: requests with the same
    session id prefer the replicas of the session's last turn, unless those have more than affinity_max_gap
    requests in flight beyond the least busy replica. max_queued_requests: requests waiting for room before new
    ones get RESOURCE_EXHAUSTED; queue_timeout_s: how long one may wait. admission: a request the cluster is not
    expected to start (first token) within queue_timeout_s ("queue_timeout") or within slo.ttft_s ("slo"; needs
    slo.ttft_s) at its measured start rate is refused at once, 429 with Retry-After / RESOURCE_EXHAUSTED
    (router/admission.py). kv_events_interval_s: how often the router polls every replica's KV events and load.
    request_timeout_s: every request's deadline (a client may ask for less); when it passes the request is
    aborted everywhere (DEADLINE_EXCEEDED / HTTP 504). max_migrations: how many times one request may continue
    on another replica after one serving it died (decode: by token replay; prefill: prefilled again); 0 ends it
    UNAVAILABLE at the first death. prefill_queue_tokens: late binding; a request whose prefill replica has this many
    uncached tokens queued waits at the router, holding no decode room, until a prefill replica's queue is shorter
    (a replica that joins the pool then takes the backlog's next request; 0: send every request at once).
    token_channel: stream decode replicas' outputs to the router over their token channels (one TCP connection
    per replica; replica/token_channel.py) instead of Ray streaming calls, which cost about 2 ms of CPU per token
    more. limits: what one request may ask for (router/limits.py). prefix_pull_min_blocks: a prefill replica pulls
    a prompt's prefix over the KV transfer from a replica holding it on its device (another prefill replica, or the
    decode replica that decoded a session's last turn) when that saves at least this many blocks of prefill net of
    the pull's measured cost (router/prefix_pulls.py; 0: never). drain_timeout_s: how long a draining router (SIGTERM
    to `tandem up`, `tandem down --drain`) lets running requests finish before everything stops."""

    policy: Literal["cache_aware", "least_loaded", "round_robin", "random"] = "cache_aware"
    weights: RoutingWeightsSettings = RoutingWeightsSettings()
    local_prefill_max_tokens: int = Field(0, ge=0)
    prefill_saturation_tokens: int = Field(0, ge=0)
    session_affinity: bool = False
    affinity_max_gap: int = Field(4, ge=0)
    max_queued_requests: int = Field(256, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    admission: Literal["queue_timeout", "slo"] = "queue_timeout"
    kv_events_interval_s: float = Field(0.05, gt=0, le=10)
    request_timeout_s: float = Field(600.0, gt=0)
    max_migrations: int = Field(3, ge=0)
    prefill_queue_tokens: int = Field(0, ge=0)
    token_channel: bool = True
    limits: RequestLimits = RequestLimits()
    prefix_pull_min_blocks: int = Field(4, ge=0)
    drain_timeout_s: float = Field(30.0, gt=0)


class Transport(_Strict):
    """KV transfer settings (kv_transfer/config.py). host: null takes each node's IP address as Ray sees it.
    shared_memory (opt-in): replicas on one host (same kernel, PID namespace and user) pass KV by reference, the
    decode replica reading the prefill replica's KV store, instead of through UCX (kv_transfer/shm.py)."""

    kind: Literal["ucx"] = "ucx"
    host: str | None = None
    layer_group: int = Field(1, ge=1)
    max_message_bytes: int = Field(16 << 20, ge=4096)
    staging_bytes: int = Field(128 << 20, ge=8192)
    lease_s: float = Field(30.0, gt=0)
    shared_memory: bool = False
    ucx_env: dict[str, str] = Field(default_factory=dict)

    @field_validator("max_message_bytes", "staging_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return parse_bytes(value)


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:50051), got {value!r}")
    return value


class Listen(_Strict):
    """grpc: where the router serves the gRPC API; http: the OpenAI-compatible HTTP API (null: not served)."""

    grpc: str = "127.0.0.1:50051"
    http: str | None = None

    @field_validator("grpc", "http")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        return None if value is None else _host_port(value)


class ApiKey(_Strict):
    """One client key and the tenant it authenticates as. Exactly one of key (inline), key_env (an environment
    variable of the process that runs `tandem up`) or key_file (a file holding the key) gives it."""

    tenant: str = Field(min_length=1, max_length=128)
    key: str | None = Field(None, min_length=8)
    key_env: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ApiKey:
        given = [name for name in ("key", "key_env", "key_file") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of key, key_env or key_file (got {', '.join(given) or 'none'})")
        return self

    def resolve(self) -> str:
        """The key itself. Raises ValueError naming the missing variable or unreadable file."""
        if self.key is not None:
            return self.key
        if self.key_env is not None:
            value = os.environ.get(self.key_env, "").strip()
            if not value:
                raise ValueError(f"environment variable {self.key_env} (the key of tenant {self.tenant!r}) is not set")
            return value
        try:
            value = Path(self.key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read the key of tenant {self.tenant!r} from {self.key_file}: "
                             f"{e.strerror}") from None
        if not value:
            raise ValueError(f"{self.key_file} (the key of tenant {self.tenant!r}) is empty")
        return value


class AuthSettings(_Strict):
    """API keys for both the gRPC and the HTTP API (`authorization: Bearer KEY`). No keys: no authentication.
    A key's tenant also salts the prefix cache, so tenants never share cached KV blocks, and scopes request and
    session ids. tenants: each tenant's priority range, request cap, rate limits and fair-share weight;
    default_tenant: everyone else's (and every request's when authentication is off)."""

    api_keys: list[ApiKey] = Field(default_factory=list)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    default_tenant: TenantLimits = TenantLimits()

    @model_validator(mode="after")
    def _tenants_have_keys(self) -> AuthSettings:
        named = {entry.tenant for entry in self.api_keys}
        if unknown := sorted(set(self.tenants) - named):
            raise ValueError(f"auth.tenants names {', '.join(map(repr, unknown))}, which no api_keys entry "
                             f"authenticates as")
        return self

    def resolve(self) -> dict[str, str]:
        """key -> tenant. Raises ValueError for a key that cannot be read or is given twice."""
        keys: dict[str, str] = {}
        for entry in self.api_keys:
            key = entry.resolve()
            if key in keys:
                raise ValueError(f"tenants {keys[key]!r} and {entry.tenant!r} have the same API key")
            keys[key] = entry.tenant
        return keys


class TLSSettings(_Strict):
    """TLS for the gRPC and the HTTP API (both serve TLS only). cert_file, key_file: the router's PEM certificate
    (chain) and its unencrypted private key; client_ca_file: when set, clients must present a certificate signed
    by this CA (mutual TLS). ca_file: what `tandem up --ask` trusts when it calls the cluster (default: cert_file,
    which is right for a self-signed certificate; give the CA that signed cert_file otherwise). Relative paths
    start where tandem runs and are made absolute here, when the manifest is parsed: the router reads the files
    on this node, but its working directory need not be this one."""

    cert_file: str = Field(min_length=1)
    key_file: str = Field(min_length=1)
    client_ca_file: str | None = Field(None, min_length=1)
    ca_file: str | None = Field(None, min_length=1)

    @field_validator("cert_file", "key_file", "client_ca_file", "ca_file")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())

    def router_config(self) -> TLSConfig:
        """What the router takes (it reads the files when it starts)."""
        return TLSConfig(self.cert_file, self.key_file, self.client_ca_file)

    @property
    def client_ca(self) -> str:
        """The CA file a client of this cluster trusts."""
        return self.ca_file or self.cert_file


class RaySettings(_Strict):
    """address: null connects to a running local cluster or starts one; 'auto' requires a running cluster (`ray up`);
    'HOST:PORT' connects there. namespace: where the cluster's named actors live. host: the address a local Ray head
    that `tandem up` starts listens on (Ray authenticates nothing by default: anyone who reaches its ports can run
    code, so the default is loopback; see docs/SECURITY.md before widening it)."""

    address: str | None = None
    namespace: str = "tandem"
    host: str = "127.0.0.1"


MODE_NEEDS_PREFILL = "disaggregated mode needs a prefill pool (pools.prefill); or set mode: colocated"
COLOCATED_HAS_PREFILL = ("colocated mode runs only the decode pool (its replicas prefill themselves); remove "
                         "pools.prefill or set mode: disaggregated")


class Manifest(_Strict):
    name: str = "tandem"
    model: str = "embedded"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    ray: RaySettings = RaySettings()
    pools: Pools
    router: RouterSettings = RouterSettings()
    transport: Transport = Transport()
    listen: Listen = Listen()
    auth: AuthSettings = AuthSettings()
    tls: TLSSettings | None = None
    slo: SLOSettings = SLOSettings()
    lora: LoRASettings | None = None  # LoRA adapters (None: the base model only)
    observability: ObservabilitySettings = ObservabilitySettings()

    @model_validator(mode="after")
    def _pools_for_mode(self) -> Manifest:
        if self.mode == "disaggregated" and self.pools.prefill is None:
            raise ValueError(MODE_NEEDS_PREFILL)
        if self.mode == "colocated" and self.pools.prefill is not None:
            raise ValueError(COLOCATED_HAS_PREFILL)
        return self

    @property
    def model_path(self) -> str | None:
        """None for the embedded model."""
        return None if self.model == "embedded" else self.model

    def pool(self, name: str) -> Pool:
        """The pool called name ("prefill" | "decode"); KeyError if the manifest has none of that name."""
        pool = getattr(self.pools, name, None) if name in ("prefill", "decode") else None
        if pool is None:
            raise KeyError(f"the manifest has no {name!r} pool (it has {', '.join(n for n, _ in self.pool_items())})")
        return pool

    def pool_items(self) -> list[tuple[str, Pool]]:
        return [(name, pool) for name, pool in (("prefill", self.pools.prefill), ("decode", self.pools.decode))
                if pool is not None]
