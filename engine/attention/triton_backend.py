"""The Triton attention backend: the same interface as TorchAttentionBackend (write_kv, forward), with decode-only
batches on the split-K paged decode kernel (triton_decode.py) and every other batch (prefill chunks, with any
decodes mixed in as one-token chunks) on the paged prefill kernel (triton_prefill.py). Both read K/V straight
from the engine's paged cache through the block tables; the new tokens' K/V are scattered into it first, as the
reference does.

select_backend builds the backend a replica runs: choose_backend holds the decision (auto is Triton on CUDA and
the reference elsewhere, and a failing Triton import is an error, never a silent fallback), and the choice is
logged once as "attention backend: <name> (<reason>)"."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tandem.engine.attention.kv_quant import convert_blocks
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.engine_config import ATTENTION_BACKENDS
from tandem.engine.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)


class TritonAttentionBackend(TorchAttentionBackend):
    """Stateless; one instance serves every layer. Importing it imports Triton (see select_backend)."""

    def __init__(self):
        from tandem.engine.attention import triton_decode, triton_norm, triton_prefill

        self._decode_kernel = triton_decode.paged_decode_attention
        self._prefill_kernel = triton_prefill.paged_prefill_attention
        self.fused = triton_norm  # rms_norm (with the residual add) and rotary_, used by the model

    def tune(self, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
             device: torch.device, windows: set[int | None] = frozenset({None}), *, batch: int = 16,
             context: int = 1024, kv_dtype: torch.dtype | None = None) -> str:
        """Runs both kernels once on a representative batch of this model's shape (decode: `batch` sequences of
        `context` tokens; prefill: one chunk of `context` tokens), so that Triton compiles them and times its
        candidate tile shapes now (triton.autotune: once per shape and dtype) rather than on a request. windows:
        the model's sliding windows (None: full attention), each its own compiled variant. Returns what was chosen,
        for the log. kv_dtype: what the KV cache stores (None: dtype; a quantized cache compiles its own variant).
        Frees what it allocated."""
        from tandem.engine.attention import triton_decode, triton_prefill

        start = time.perf_counter()
        blocks = -(-context // block_size)
        kv = torch.randn(2, batch * blocks, kv_heads, block_size, head_dim, dtype=dtype, device=device)
        if kv_dtype is not None and kv_dtype != dtype:
            kv = convert_blocks(kv, block_size, kv_dtype)
        tables = torch.arange(batch * blocks, device=device).view(batch, blocks)
        lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        decode_q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
        prefill_q = torch.randn(context, heads, head_dim, dtype=dtype, device=device)
        starts = torch.tensor([0, context], dtype=torch.int64, device=device)
        for window in sorted(windows, key=lambda w: w or 0):
            self._decode_kernel(decode_q, kv, tables, lens, head_dim**-0.5, window)
            self._prefill_kernel(prefill_q, kv, tables[:1], starts, lens[:1], context, head_dim**-0.5, window)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        del kv, decode_q, prefill_q
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return (f"attention kernels tuned in {time.perf_counter() - start:.1f} s: decode "
                f"{triton_decode._split_kernel.best_config}; prefill {triton_prefill._prefill_kernel.best_config}")

    def takes_paged(self, meta: AttentionMetadata, kv: torch.Tensor, q_dtype: torch.dtype) -> bool:
        return False  # the CPU's paged kernel: never here

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        self.write_kv(k, v, kv, meta)
        if meta.is_decode_only:
            out = self._decode_kernel(q, kv, meta.block_tables, meta.seq_lens_tensor, scale, window,
                                      num_splits=meta.decode_splits)
        else:
            starts = meta.per_step("query_start_loc", lambda: torch.tensor(meta.query_start_loc, device=q.device))
            max_query = max(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:]))
            out = self._prefill_kernel(q, kv, meta.block_tables, starts, meta.seq_lens_tensor, max_query, scale,
                                       window)
        return out.reshape(q.shape[0], -1)


@dataclass(frozen=True)
class BackendChoice:
    """Which attention backend runs and why. name: "torch" or "triton"; reason: what decided it, for the log
    ("cuda", "cpu device", "attention_backend: torch", ...)."""

    name: str
    reason: str

    def summary(self) -> str:
        """e.g. "triton (cuda)": what a replica reports for each rank."""
        return f"{self.name} ({self.reason})"

    def describe(self) -> str:
        """The line select_backend logs, e.g. "attention backend: triton (cuda)"."""
        return f"attention backend: {self.summary()}"


def choose_backend(name: str, device_type: str, triton_import_error: str | None) -> BackendChoice:
    """The decision alone, without importing Triton. name: one of ATTENTION_BACKENDS; device_type: "cuda", "cpu",
    ...; triton_import_error: the text of the ImportError that importing the Triton kernels raised, or None when
    they import (or were not tried).

    "torch" is the reference anywhere. "auto" is Triton on CUDA and the reference elsewhere. "triton" is Triton on
    any device (off CUDA the kernels need Triton's interpreter, TRITON_INTERPRET=1, as the tests run them).
    Raises ValueError for an unknown name, and whenever Triton would be chosen but failed to import: a broken
    install is reported, never replaced by the slower reference."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch":
        return BackendChoice("torch", "attention_backend: torch")
    if name == "auto" and device_type != "cuda":
        return BackendChoice("torch", f"{device_type} device")
    if triton_import_error is not None:
        raise ValueError(f"attention_backend {name!r} on a {device_type} device needs Triton, which failed to "
                         f"import: {triton_import_error}. Install it (pip install triton), or set "
                         f"attention_backend: torch to run the reference backend")
    return BackendChoice("triton", "cuda" if device_type == "cuda" else f"{device_type} device, Triton interpreter")


def _triton_import_error() -> str | None:
    """Imports the Triton kernels; returns the ImportError's text, or None when they import."""
    try:
        from tandem.engine.attention import triton_decode, triton_norm, triton_prefill  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def tune_for(model, block_size: int, *, log: bool = True, kv_dtype: torch.dtype | None = None) -> None:
    """On CUDA with the Triton backend: tunes its kernels for this model (its rank's heads, head_dim, dtype and
    sliding windows) and KV cache dtype (None: the model's dtype) before the engine serves, logging the choice at
    INFO with log. Nothing elsewhere."""
    backend = model.attention
    if not isinstance(backend, TritonAttentionBackend) or model.device.type != "cuda":
        return
    windows = {layer.window for layer in model.layers} or {None}
    chosen = backend.tune(model.num_heads, model.num_kv_heads, model.config.head_dim, block_size, model.dtype,
                          model.device, windows, kv_dtype=kv_dtype)
    if log:
        logger.info(chosen)


def select_backend(name: str, device: torch.device, *, log: bool = True) -> TorchAttentionBackend:
    """Builds the attention backend that choose_backend picks for name on device; Triton is imported only when
    it would be chosen. The returned backend carries the decision as `.choice` (a BackendChoice). With log, logs
    choice.describe() once at INFO (callers pass log=False on all ranks but one, so a replica logs it once).
    Raises ValueError as choose_backend does: an unknown name, or Triton chosen but not importable."""
    choice = choose_backend(name, device.type, None)
    if choice.name == "triton":
        choice = choose_backend(name, device.type, _triton_import_error())
    backend = TritonAttentionBackend() if choice.name == "triton" else TorchAttentionBackend()
    backend.choice = choice
    if log:
        logger.info(choice.describe())
    return backend
