"""The decode step on a CUDA GPU: CUDA graphs, one set per batch-size bucket, either "full" (the whole step with
attention inside, one graph per bucket) or "piecewise" (graphs around attention, which runs eagerly between them).

At batch 1 an eager decode step of the embedded model is about 450 kernel launches from Python (norms, rotary,
products, MLPs: ~15 per layer), and the GPU waits on the CPU between them (measured on an H200: 80 tok/s eager,
launch-bound). A CUDA graph replays a captured sequence of kernels with one launch.

Full graphs (as vLLM's full decode graphs): one graph per bucket records the layer stack with attention included,
over static inputs whose shapes are fixed per bucket (engine/models/decode_bucket.py: token ids, positions, block
tables as wide as the longest sequence can need, sequence lengths, slots, the decode kernel's split count). A step
copies its rows into them, padding rows copying row 0 (decode_bucket.py says why that leaves the KV cache exactly as
the real rows write it), replays once and returns the real rows; sampling follows. They need the Triton attention
backend (the torch reference reads Python-side sequence lengths, which a graph cannot take), the KV cache the step
writes at build time (its storage is baked into the graph) and the most blocks a sequence can hold.

Piecewise graphs (the fallback, where full graphs do not apply or their capture fails, the reason logged at
warm-up): attention stays outside, as in vLLM's piecewise graphs, run eagerly on the rows of the real batch, so a
step is L + 1 graph replays (before the first attention, between two attentions, after the last). On an H200 a
batch of 64 cost as much as a batch of 8 (6.3 ms): the GPU idled between the pieces.

Batch sizes are bucketed (1, 2, 4, 8, then every multiple of 8 up to max_batch): a batch of n sequences replays the
smallest bucket >= n, its inputs padded with rows whose results are dropped (no op outside attention mixes rows, so
padding cannot change a real row's result beyond the matrix library's choice of algorithm for that row count).
Every bucket is captured at warm-up (engine start); a step never captures. The graphs share one memory pool and are
captured largest first, so the buckets' temporaries reuse one another's memory. With full graphs, a step the graphs
cannot take runs eager, the reason logged once: a layer observer watching it layer by layer (KV transfer sends a
prompt's layers as they are written: a one-token step completing a prompt), another KV cache, a block table wider
than the graphs'.

The graphs run the same kernels as eager mode (no inductor fusion on the GPU yet): the gain is the launches, not
the kernels. Compiled.py's `compile_decode` builds this on CUDA; what it says there about when a step is compiled
holds here too (decode-only steps of a whole model in one process, no MoE layers).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from tandem.engine.attention.triton_backend import TritonAttentionBackend
from tandem.engine.models.decode_bucket import BucketShape, DecodeInputs, run_body

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


def why_not_full(model: LlamaModel, kv_cache: PagedKVCache | None, max_blocks: int | None) -> str | None:
    """Why the decode step cannot be captured whole (attention inside), or None if it can be tried."""
    if not isinstance(model.attention, TritonAttentionBackend):
        return (f"attention runs on {type(model.attention).__name__}, whose decode path reads Python-side sequence "
                "lengths (full graphs need the Triton backend)")
    if kv_cache is None or max_blocks is None:
        return "the KV cache and the most blocks a sequence holds were not given when the graphs were built"
    if kv_cache.spec.quantized:
        return "the quantized KV cache's writes size their work from the data"
    return None


@dataclass
class _FullBucket:
    """One batch size's full graph: its static inputs and the hidden states its replay leaves."""

    inputs: DecodeInputs
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # [size, hidden]


@dataclass
class _Bucket:
    """One batch size's piecewise graphs and the static tensors they read and write."""

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
    """The model's decode step as CUDA graphs for 1..max_batch sequences, full where they apply (why_not_full) and
    piecewise otherwise. Build it with compiled.compile_decode (which warms it up); the same interface as
    compiled.CompiledDecode. kv_cache: the cache every step writes (its storage is baked into full graphs);
    max_blocks: the most blocks a sequence can hold (the block tables' static width). Without them, piecewise."""

    def __init__(self, model: LlamaModel, max_batch: int, *, kv_cache: PagedKVCache | None = None,
                 max_blocks: int | None = None):
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        self.model = model
        self.max_batch = max_batch
        self.max_query_len = 1  # decode-only batches: a speculating step runs eager
        self.sizes = batch_buckets(max_batch)
        self.kv_cache = kv_cache
        self.max_blocks = max_blocks
        self.why_piecewise = why_not_full(model, kv_cache, max_blocks)  # None: full graphs are tried at warm-up
        self.compiles = 0  # buckets captured
        self.fallbacks = 0  # steps run eager: no bucket holds them, or (full graphs) they cannot run in one
        self.steps = 0  # decode steps run from graphs
        self._buckets: dict[int, _Bucket] = {}
        self._full: dict[int, _FullBucket] = {}
        self._declined: set[str] = set()  # why full graphs left steps to eager, each logged once
        self._width = model.num_heads * model.config.head_dim

    @property
    def full(self) -> bool:
        """Whether steps replay full graphs (after warm-up)."""
        return bool(self._full)

    @property
    def buckets(self) -> str:
        """The batch sizes captured, in words."""
        return ", ".join(str(n) for n in self.sizes)

    @property
    def kind(self) -> str:
        return "CUDA graphs, full" if self._full else "CUDA graphs, piecewise"

    def warm_up(self) -> float:
        """Captures every bucket, largest first: full graphs where they apply, piecewise ones where they do not or
        where their capture fails (the reason logged). Returns the seconds it took. Raises what piecewise capture
        raises (the caller then runs eager). Full capture runs each bucket's body once eagerly first, which
        writes slot 0 of every layer's cache; that block is saved before and restored after, so the cache is left
        as it was found, provided nothing else uses it meanwhile (true at engine start)."""
        start = time.perf_counter()
        if self.why_piecewise is None:
            try:
                self._capture_full()
            except Exception as e:  # noqa: BLE001 - the piecewise graphs are always correct
                self._full.clear()
                self.compiles = 0
                torch.cuda.empty_cache()
                self.why_piecewise = f"full capture failed: {type(e).__name__}: {' '.join(str(e).split())}"
                _log.warning("decode step's CUDA graphs run piecewise: %s", self.why_piecewise)
        else:
            _log.info("decode step's CUDA graphs run piecewise: %s", self.why_piecewise)
        if not self._full:
            self._capture_piecewise()
        return time.perf_counter() - start

    def _capture_full(self) -> None:
        model, kv_cache, device = self.model, self.kv_cache, self.model.device
        block_size = kv_cache.spec.block_size
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            block_zero = kv_cache.data[:, :, 0].clone()  # the warm-up runs write slot 0
            try:
                for size in sorted(self.sizes, reverse=True):
                    inputs = DecodeInputs(BucketShape.plan(size, self.max_blocks, model.num_kv_heads), block_size,
                                          device)
                    run_body(model, inputs, kv_cache)  # Triton compiles (and tunes) here, outside the capture
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        output = run_body(model, inputs, kv_cache)
                    finally:
                        graph.capture_end()
                    self._full[size] = _FullBucket(inputs, graph, output)
                    self.compiles += 1
            finally:
                kv_cache.data[:, :, 0] = block_zero
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    def _capture_piecewise(self) -> None:
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

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: PagedKVCache, on_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        """The step's hidden states [n, hidden], or None when the graphs cannot run it (the caller runs it eager):
        no bucket holds n sequences, or full graphs cannot take the step (the reason logged once)."""
        n = input_ids.shape[0]
        size = bucket_for(self.sizes, n)
        if size is None:
            self.fallbacks += 1
            return None
        with torch.inference_mode():
            if self._full:
                return self._replay_full(self._full[size], input_ids, positions, meta, kv_cache, on_layer)
            bucket = self._buckets.get(size)
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
                bucket.attention_out[index][:n].copy_(model.attend(index, q[:n], k[:n], v[:n], meta, kv_cache,
                                                                   on_layer))
            bucket.pieces[-1].replay()
            self.steps += 1
            return bucket.output[:n].clone()  # the buffer is the next replay's

    def _replay_full(self, bucket: _FullBucket, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, kv_cache: PagedKVCache,
                     on_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        n = input_ids.shape[0]
        if on_layer is not None:
            reason = "a layer observer (KV transfer) watches the step layer by layer"
        elif kv_cache is not self.kv_cache:
            reason = "the step writes another KV cache than the graphs were captured over"
        else:
            reason = bucket.inputs.refuses(n, meta)
        if reason is not None:
            self.fallbacks += 1
            if reason not in self._declined:
                self._declined.add(reason)
                _log.info("a decode step runs eager instead of its full CUDA graph: %s (logged once)", reason)
            return None
        bucket.inputs.fill(input_ids, positions, meta)
        bucket.graph.replay()
        self.steps += 1
        return bucket.output[:n].clone()  # the buffer is the next replay's
