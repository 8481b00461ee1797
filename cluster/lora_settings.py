"""The manifest's `lora` section (cluster/manifest.py): the LoRA adapters every replica serves and the rules for
loading more while the cluster runs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class LoRASettings(BaseModel):
    """LoRA adapters served beside the model by every replica of both pools (engine/models/lora.py): clients name
    one in the OpenAI `model` field. adapters: name -> PEFT folder (adapter_config.json and
    adapter_model.safetensors), read by every node at that path. max_loaded: adapters a replica computes with at
    once (its preallocated pool; others wait their turn), max_rank: the highest rank it takes. runtime_loading:
    POST /v1/load_lora_adapter and /v1/unload_lora_adapter may change the set while the cluster runs, for the
    tenants in admin_tenants when API keys are on (off by default: a path on the replicas' disks is the caller's
    choice)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: dict[str, str] = {}
    max_rank: int = Field(16, ge=1, le=256)
    max_loaded: int = Field(4, ge=1)
    runtime_loading: bool = False
    admin_tenants: list[str] = []

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name in adapters:
            if not 0 < len(name) <= 128:
                raise ValueError(f"an adapter's name has 1..128 characters, got {name!r}")
        return adapters

    def config(self):
        from tandem.engine.engine_config import LoRAConfig

        return LoRAConfig(max_rank=self.max_rank, max_loaded=self.max_loaded)
