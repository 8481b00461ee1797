"""The LoRA adapters an engine serves, by name: registered with a PEFT folder (its headers checked here), told to
every rank with the next step (SchedulerOutput.lora_changes), which reads it when a step first needs it
(engine/models/lora.py LoRAPool). Torch-free apart from the check."""

from __future__ import annotations

import time
from pathlib import Path

from tandem.engine.engine_config import LoRAConfig
from tandem.engine.errors import TandemError
from tandem.engine.model_config import ModelConfig
from tandem.engine.sampling_params import MAX_LORA_NAME, SamplingParams
from tandem.engine.scheduler_output import LoRAChange


class UnknownAdapterError(TandemError, ValueError):
    """A request or call names a LoRA adapter this engine does not serve."""


class LoRARegistry:
    """config None: the engine serves the base model only, and every adapter is refused with the reason."""

    def __init__(self, config: LoRAConfig | None, model: ModelConfig):
        self.config, self.model = config, model
        self.paths: dict[str, str] = {}
        self._served: dict[str, str] = {}  # every name served since start -> its folder (names are never reused)
        self._changes: list[LoRAChange] = []

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def load(self, name: str, path: str | Path) -> float:
        """Registers adapter `name` from `path` once it reads as one this model can serve; returns the seconds the
        check took (0 for the same name and folder again: nothing changes). A name stays bound to its folder while
        the engine lives, unloaded or not, because its cached KV (prefix cache, KV tiers) is keyed by the name.
        Raises ValueError (LoRAAdapterError for the adapter's files)."""
        from tandem.engine.loader.lora_adapter import check_adapter

        if self.config is None:
            raise ValueError("this engine serves no LoRA adapters: give it a lora config (lora.max_rank, max_loaded)")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME:
            raise ValueError(f"a LoRA adapter's name has 1..{MAX_LORA_NAME} characters, got {name!r}")
        folder = str(Path(path).resolve())
        if self._served.get(name, folder) != folder:
            raise ValueError(f"LoRA adapter name {name!r} was served from {self._served[name]} on this replica: "
                             "give another folder another name (cached KV is keyed by the name)")
        if self.paths.get(name) == folder:
            return 0.0
        start = time.perf_counter()
        check_adapter(folder, self.model, self.config.max_rank)  # headers only: each rank reads the weights
        self.paths[name] = self._served[name] = folder
        self._changes.append(LoRAChange(name, folder))
        return time.perf_counter() - start

    def unload(self, name: str) -> None:
        """Forgets adapter `name`. Raises UnknownAdapterError if it is not registered."""
        if self.paths.pop(name, None) is None:
            raise UnknownAdapterError(f"no LoRA adapter named {name!r} is loaded")
        self._changes.append(LoRAChange(name, None))

    def check(self, params: SamplingParams) -> None:
        """Raises UnknownAdapterError for a request naming an adapter that is not registered."""
        if params.lora is not None and params.lora not in self.paths:
            known = ", ".join(sorted(self.paths)) or "none"
            raise UnknownAdapterError(f"no LoRA adapter named {params.lora!r} is loaded (loaded: {known})")

    def take_changes(self) -> tuple[LoRAChange, ...]:
        """What the ranks have not been told yet, in order; then nothing until the next load or unload."""
        changes, self._changes = tuple(self._changes), []
        return changes
