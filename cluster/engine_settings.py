"""A pool's `engine:` section of the manifest, derived from the engine's own configuration types: every field of
EngineConfig and SpeculativeConfig (both engine/engine_config.py), with its type, its range
(the annotated_types in its annotation) and its default, is a manifest key as it is, so that a new engine setting
needs one definition. What the manifest adds on top:

- kv_cache_bytes takes units ("256MiB");
- speculative is a section of its own (null: off), reaching only the replicas that decode;
- kv_tiers is a section of its own (null: off), its byte budgets with units ("8GiB");
- the replica's device, dtype, weights and load_format (replica/spec.py ReplicaSpec), beside the engine's settings.

The section's compile: null means "on for the pools that decode, off for a disaggregated cluster's prefill pool"
(cluster/replica_plans.py); the engine's own null means TANDEM_COMPILE. Building the engine's dataclass runs its
own checks (__post_init__), so a manifest is refused for whatever the engine would refuse, at load time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from tandem.engine.engine_config import EngineConfig, KVTiersConfig, LoadFormat, SchedulingConfig, SpeculativeConfig
from tandem.replica.spec import ReplicaSpec
from tandem.router.limits import parse_bytes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _fields_of(config_type: type, *, skip: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
    """The dataclass's fields as pydantic field definitions: (annotated type, default)."""
    hints = get_type_hints(config_type, include_extras=True)
    fields = {}
    for f in dataclasses.fields(config_type):
        if f.name in skip:
            continue
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{config_type.__name__}.{f.name} has no plain default; a manifest key needs one")
        fields[f.name] = (hints[f.name], f.default)
    return fields


def _section_of(config_type: type, *, skip: tuple[str, ...] = ()) -> type[_Strict]:
    """A frozen, strict pydantic model with config_type's fields (minus skip), to subclass."""
    return create_model(f"_{config_type.__name__}Fields", __base__=_Strict, __module__=__name__,
                        **_fields_of(config_type, skip=skip))


_SPECULATIVE_KEYS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))


class SpeculativeSettings(_section_of(SpeculativeConfig)):
    """Speculative decoding on a pool's replicas (engine/decoding/speculation.py): a cheap proposer (ngram, suffix, or
    draft: a draft model, "self" being the target's own GGUF weights run 4-bit) guesses each decoding sequence's
    next tokens and the model verifies them in its step; a cost model measured on the replica keeps only proposals
    that pay (none at a large batch or a low acceptance). The output is the same as without. adaptive: false turns
    the cost model off and verifies max_tokens proposals whenever the proposer has them (tests and benchmarks of
    verification; a server keeps the default)."""

    @model_validator(mode="after")
    def _checked_by_the_engine(self) -> SpeculativeSettings:
        self.config()
        return self

    def config(self) -> SpeculativeConfig:
        return SpeculativeConfig(**{name: getattr(self, name) for name in _SPECULATIVE_KEYS})


class KVTiersSettings(_Strict):
    """KV cache tiers below each replica's device pool (engine/core/kv_tiers.py): prefix blocks the pool evicts
    are kept in host memory (host_bytes for the whole replica, page-locked on a GPU) and, with disk_path, in files
    under that folder (disk_bytes at most, one folder per replica and rank, removed when it stops), each LRU. A
    request whose prefix is on a tier has it copied back instead of computed."""

    host_bytes: int = Field(ge=1)
    disk_path: str | None = None
    disk_bytes: int | None = Field(None, ge=1)

    @field_validator("host_bytes", "disk_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @model_validator(mode="after")
    def _checked_by_the_engine(self) -> KVTiersSettings:
        self.config()
        return self

    def config(self) -> KVTiersConfig:
        return KVTiersConfig(self.host_bytes, self.disk_path, self.disk_bytes)


_TENANT_KEYS = ("tenant_weights", "default_weight")  # from auth.tenants.<name>.weight and auth.default_tenant


class SchedulerSettings(_section_of(SchedulingConfig, skip=_TENANT_KEYS)):
    """A pool's `scheduler:` section: the order its replicas serve sequences in and priority preemption
    (engine/core/scheduling_policy.py). The fair policy's weights are the tenants' (auth.tenants.<name>.weight)."""

    @model_validator(mode="after")
    def _checked_by_the_engine(self) -> SchedulerSettings:
        self.config()
        return self

    def config(self, tenant_weights: tuple[tuple[str, float], ...] = (), default_weight: float = 1.0
               ) -> SchedulingConfig:
        return SchedulingConfig(self.policy, self.preempt_after_s, self.sjf_aging_s, self.fair_reserve_s,
                                tenant_weights=tenant_weights, default_weight=default_weight)


# the engine's, but taken differently here (see the module doc); lora from the manifest's own section, for every
# pool; scheduling from the pool's scheduler section
_OWN_KEYS = ("kv_cache_bytes", "speculative", "kv_tiers", "lora", "scheduling")
ENGINE_KEYS = tuple(_fields_of(EngineConfig, skip=_OWN_KEYS))  # taken as the engine defines them
_REPLICA = {f.name: f.default for f in dataclasses.fields(ReplicaSpec)}


class EngineSettings(_section_of(EngineConfig, skip=_OWN_KEYS)):
    """The engine settings of each replica of a pool: EngineConfig's keys, and the replica's device, dtype and
    weights (see the module doc)."""

    kv_cache_bytes: int | None = Field(None, ge=1)
    speculative: SpeculativeSettings | None = None
    kv_tiers: KVTiersSettings | None = None
    device: Literal["auto", "cpu", "cuda"] = _REPLICA["device"]  # auto: CUDA when Ray gave the rank a GPU
    dtype: Literal["float32", "bfloat16"] | None = _REPLICA["dtype"]  # None: bfloat16 on CUDA or quantized weights
    # How projection weights are held (engine_config.WEIGHT_FORMATS): dense in dtype; packed (a GGUF file's 4-bit
    # layers, CPU); int8 (any checkpoint, CPU and CUDA); int4 / int4_g128 (group-wise 4-bit, CPU). All but dense
    # compute in bfloat16.
    weights: Literal["dense", "packed", "int8", "int4", "int4_g128"] = _REPLICA["weights"]
    # Where the weights come from (engine_config.LOAD_FORMATS): auto reads the model's files; dummy makes random
    # weights of its shapes on each rank's device (a folder of config.json and tokenizer is enough: `tandem
    # make-model --like NAME`), to measure a model this machine does not have. Its answers are noise.
    load_format: LoadFormat = _REPLICA["load_format"]

    @field_validator("kv_cache_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two, got {value}")
        return value

    @model_validator(mode="after")
    def _checked_by_the_engine(self) -> EngineSettings:
        if self.load_format == "dummy" and self.weights == "packed":
            raise ValueError("weights: packed keeps a GGUF file's 4-bit blocks; load_format: dummy has none (use "
                             "dense, int8 or int4)")
        if self.weights != "dense" and self.dtype == "float32":
            raise ValueError(f"weights: {self.weights} computes in bfloat16; drop dtype or set it to bfloat16")
        self.config()
        return self

    def config(self, **overrides: Any) -> EngineConfig:
        """The EngineConfig these settings say, with overrides (EngineConfig's fields) on top. Raises ValueError
        where EngineConfig does."""
        values = {name: getattr(self, name) for name in ENGINE_KEYS}
        values |= {"kv_cache_bytes": self.kv_cache_bytes,
                   "speculative": self.speculative.config() if self.speculative else None,
                   "kv_tiers": self.kv_tiers.config() if self.kv_tiers else None}
        return EngineConfig(**values | overrides)
