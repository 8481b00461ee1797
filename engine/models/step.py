"""How one forward step of a model runs: the one place that chooses between the model's compiled decode step
(engine/models/compiled.py on the CPU, its CUDA graphs on a GPU: engine/models/cuda_graphs.py) and the eager
layer loop (LlamaModel.forward). The model itself knows nothing of compilation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from tandem.engine.attention import AttentionMetadata
    from tandem.engine.kv.kv_cache import PagedKVCache
    from tandem.engine.models.compiled import CompiledDecode
    from tandem.engine.models.cuda_graphs import CudaGraphDecode
    from tandem.engine.models.llama import LlamaModel


def run_step(model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             kv_cache: PagedKVCache, hidden: torch.Tensor | None = None,
             on_layer: Callable[[int], None] | None = None,
             compiled: CompiledDecode | CudaGraphDecode | None = None) -> torch.Tensor:
    """model.forward's result (its arguments as there), computed by `compiled` when it was warmed up for the
    batch: a first stage's step (no `hidden`) of at most compiled.max_batch tokens, none of its sequences adding
    more than compiled.max_query_len (1 for a decode; more for speculated tokens). Any other step, and one the
    compiled step declines (it returns None), and a step with LoRA rows, runs eager."""
    lora = model.lora is not None and model.lora.active  # LoRA deltas run eager (not captured in the step)
    if compiled is not None and hidden is None and not lora and input_ids.shape[0] <= compiled.max_batch and \
            meta.max_query_len <= compiled.max_query_len:
        if int(positions.max()) >= model.rope.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the model's {model.rope.max_positions}")
        out = compiled(input_ids, positions, meta, kv_cache, on_layer)
        if out is not None:
            return out
    return model.forward(input_ids, positions, meta, kv_cache, hidden, on_layer)
