"""The decode step on a CUDA GPU: CUDA graphs captured piecewise around attention, one set per batch-size bucket.

At batch 1 an eager decode step of the embedded model is about 450 kernel launches from Python (norms, rotary,
products, MLPs: ~15 per layer), and the GPU waits on the CPU between them (measured on an H200: 80 tok/s eager,
launch-bound). A CUDA graph replays a captured sequence of kernels with one launch. Attention stays outside the
graphs, as in vLLM's piecewise graphs: it reads the step's block tables and sequence lengths, whose sizes change
every step, and writes the KV cache at the step's slots. So a step is L + 1 graph replays (before the first
attention, between two attentions, after the last) with the model's own attention backend run eagerly between them
on the rows of the real batch.

Batch sizes are bucketed (1, 2, 4, 8, then every multiple of 8 up to max_batch): a batch of n sequences replays the
smallest bucket >= n, its inputs padded with rows whose results are dropped (no op outside attention mixes rows, so
padding cannot change a real row's result beyond the matrix library's choice of algorithm for that row count).
Every bucket is captured at warm-up (engine start); a step never captures. The graphs share one memory pool and are
captured largest first, so the buckets' temporaries reuse one another's memory.

The pieces run the same kernels as eager mode (no inductor fusion on the GPU yet): the gain is the launches, not
the kernels. Compiled.py's `compile_decode` builds this on CUDA; what it says there about when a step is compiled
holds here too (decode-only steps of a whole model in one process, no MoE layers).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from tandem.engine.attention import AttentionMetadata
    from tandem.engine.kv.kv_cache import PagedKVCache
    from tandem.engine.models.llama import LlamaModel

_log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, up to and including
    max_batch (which is always one)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def bucket_for(buckets: list[int], n: int) -> int | None:
    """The smallest bucket that holds n rows, or None if n is larger than every bucket."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class _Bucket:
    """One batch size's graphs and the static tensors they read and write."""

    size: int
    input_ids: torch.Tensor  # [size] int64, copied into before each replay
    positions: torch.Tensor  # [size] int64
    pieces: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # layers + 1 of them
    attention_in: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # q, k, v
    attention_out: list[torch.Tensor] = field(default_factory=list)  # [size, Hq * D] per layer
    output: torch.Tensor | None = None  # the last piece's hidden states


class _CaptureOps:
    """The ops run_layers calls while a bucket is captured: products run as in eager mode (captured with the piece
    around them); attention ends the piece being captured, keeps its inputs and hands back the static buffer the
    real attention will fill, then begins the next piece."""

    def __init__(self, bucket: _Bucket, pool, attention_width: int, dtype: torch.dtype, device: torch.device):
        self.bucket = bucket
        self.pool = pool
        self.width = attention_width
        self.dtype = dtype
        self.device = device

    @staticmethod
    def project(projection, x: torch.Tensor) -> torch.Tensor:
        return projection(x)

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        self.bucket.pieces.append(graph)
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.bucket.pieces[-1].capture_end()
        self.bucket.attention_in.append((q, k, v))
        out = torch.empty(self.bucket.size, self.width, dtype=self.dtype, device=self.device)  # outside the pool
        self.bucket.attention_out.append(out)
        self.begin()
        return out


class _WarmOps:
    """Eager products and zeros for attention: one run before capture, so that every kernel's lazy set-up (the
    matrix library's handles, Triton's compilation) happens outside a graph."""

    def __init__(self, attention_width: int):
        self.width = attention_width

    @staticmethod
    def project(projection, x: torch.Tensor) -> torch.Tensor:
        return projection(x)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.new_zeros(q.shape[0], self.width)


class CudaGraphDecode:
    """The model's decode step as piecewise CUDA graphs for 1..max_batch sequences. Build it with
    compiled.compile_decode (which warms it up); the same interface as compiled.CompiledDecode."""

    def __init__(self, model: LlamaModel, max_batch: int):
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        self.model = model
        self.max_batch = max_batch
        self.max_query_len = 1  # decode-only batches: a speculating step runs eager
        self.sizes = batch_buckets(max_batch)
        self.compiles = 0  # buckets captured
        self.fallbacks = 0  # steps run eager because no bucket holds them
        self.steps = 0  # decode steps run from graphs
        self._buckets: dict[int, _Bucket] = {}
        self._width = model.num_heads * model.config.head_dim

    @property
    def buckets(self) -> str:
        """The batch sizes captured, in words."""
        return ", ".join(str(n) for n in self.sizes)

    @property
    def kind(self) -> str:
        return "CUDA graphs"

    def warm_up(self) -> float:
        """Captures every bucket, largest first. Returns the seconds it took. Raises what capture raises (the
        caller then runs eager)."""
        start = time.perf_counter()
        device, dtype = self.model.device, self.model.dtype
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                zeros = torch.zeros(size, dtype=torch.int64, device=device)
                bucket = _Bucket(size, zeros, zeros.clone())
                self.model.run_layers(bucket.input_ids, bucket.positions, None, _WarmOps(self._width))
                torch.cuda.synchronize(device)
                ops = _CaptureOps(bucket, pool, self._width, dtype, device)
                ops.begin()
                try:
                    bucket.output = self.model.run_layers(bucket.input_ids, bucket.positions, None, ops)
                finally:
                    bucket.pieces[-1].capture_end()
                self._buckets[size] = bucket
                self.compiles += 1
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: PagedKVCache, on_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        """The step's hidden states [n, hidden], or None when no bucket holds n sequences (the caller runs it
        eager)."""
        n = input_ids.shape[0]
        size = bucket_for(self.sizes, n)
        bucket = self._buckets.get(size) if size is not None else None
        if bucket is None:
            self.fallbacks += 1
            return None
        # Rows n.. keep whatever the last step left there: valid token ids and positions, results dropped.
        bucket.input_ids[:n].copy_(input_ids, non_blocking=True)
        bucket.positions[:n].copy_(positions, non_blocking=True)
        model = self.model
        for index, piece in enumerate(bucket.pieces[:-1]):
            piece.replay()
            q, k, v = bucket.attention_in[index]
            bucket.attention_out[index][:n].copy_(model.attend(index, q[:n], k[:n], v[:n], meta, kv_cache, on_layer))
        bucket.pieces[-1].replay()
        self.steps += 1
        return bucket.output[:n].clone()  # the buffer is the next replay's
