"""What one engine replica is (model, precision, engine limits, parallel split) as a picklable value, and how it
is built: the replica shell (replica/shell.py) builds its engine from the ReplicaSpec the control plane sends."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.engine_config import EngineConfig
from tandem.engine.parallel.layout import ParallelConfig


@dataclass(frozen=True)
class ReplicaSpec:
    """model: a Hugging Face folder or .gguf path (None: the embedded model). threads: torch CPU threads for the
    whole replica (split over its ranks)."""

    model: str | None = None
    dtype: str = "float32"
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    threads: int = 1

    def build(self, kv_agent=None, event_sink=None):
        """Loads the model (only its config and tokenizer when the ranks load their own shards) and returns a
        running LLMEngine publishing its KV events to event_sink (None: nowhere). Raises ModelLoadError /
        ValueError / ReplicaFailedError like LLMEngine."""
        import torch

        from tandem.engine.llm_engine import LLMEngine
        from tandem.engine.loader import load_model

        torch.set_num_threads(max(1, self.threads))
        loaded = load_model(self.model, dtype=getattr(torch, self.dtype), progress=False,
                            weights=self.parallel.world_size == 1)
        from tandem.engine.kv_events import discard_events

        return LLMEngine(loaded, self.engine, parallel=self.parallel, kv_agent=kv_agent,
                         event_sink=event_sink or discard_events)
