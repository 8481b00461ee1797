"""The compiled decode step: the model's layers under torch.compile, with attention and the weight products left
as opaque calls.

A decode step runs about a thousand small eager ops (norms, rotary, residual adds, SiLU, views) between the weight
products and attention. Compiled with inductor (C++ on the CPU), the ops between two opaque calls become one fused
kernel and the step is one call instead of a Python loop. What stays opaque, as torch custom ops:

- `tandem::attend`: paged attention, which reads the step's block tables and writes the KV cache (neither is a
  tensor the graph could own), run by the model's attention backend as in eager mode. The graph is thus cut
  around attention, as vLLM cuts its piecewise graphs; on the CPU the pieces need no separate capture, so they
  stay one compiled function with the attention calls inside.
- `tandem::project`: each weight product, so that it keeps the kernel the tuner measured fastest for its shape
  and row count on this CPU (engine/models/linear.py) and its weight layout (oneDNN's blocked layout cannot be a
  graph input). A projection that is one torch op already (`traceable`: the integer-dot kernels' BlockLinear)
  is traced as it is, its op called from the graph without the Python of `project` around it.

Batch sizes come in two buckets, each compiled once at warm-up (engine start), never on a request: one sequence
(static shapes) and 2..max_batch sequences (one graph with a symbolic batch size). After warm-up a call that would
need another compilation runs eager instead, with a warning. Compilation that fails leaves the model eager, with
the reason logged. Only a decode-only step of a whole model in one process is compiled; prefill chunks, mixed
batches, multi-process replicas and MoE layers run eager. On a CUDA device `compile_decode` captures CUDA graphs
instead (engine/models/cuda_graphs.py): the whole step with attention inside where it can, piecewise around
attention otherwise.

Settings: EngineConfig.compile (the manifest's `engine.compile`), and TANDEM_COMPILE=off, which turns it off
where the config leaves it unset. Inductor's cache lives under tandem's cache directory, one folder per machine key
(engine/hardware/kernel_tuning.py: CPU model, torch's capability, flags, oneDNN's ISA cap, torch version, threads), so
the first start on a machine compiles (about half a minute per bucket on 2 cores for the embedded model) and later
starts read the cache. Inductor's own key does not cover torch's capability setting: code cached under
ATEN_CPU_CAPABILITY=avx512 and run under avx2 produced NaN (measured), so one shared folder is not safe where home
directories are shared by different CPUs. A TORCHINDUCTOR_CACHE_DIR set before tandem starts is used as it is.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from tandem.engine.hardware.cache_dir import cache_root
from tandem.engine.hardware.kernel_tuning import machine_digest
from tandem.engine.models.mlp import GatedMLP

if TYPE_CHECKING:
    from tandem.engine.attention import AttentionMetadata
    from tandem.engine.attention.cpu_decode import PagedStep
    from tandem.engine.kv.kv_cache import PagedKVCache
    from tandem.engine.models.cuda_graphs import CudaGraphDecode
    from tandem.engine.models.llama import LlamaModel

COMPILE_ENV = "TANDEM_COMPILE"

_log = logging.getLogger(__name__)
_projections: weakref.WeakValueDictionary[int, Callable] = weakref.WeakValueDictionary()
_models: weakref.WeakValueDictionary[int, LlamaModel] = weakref.WeakValueDictionary()
_handles = iter(range(1 << 62))
# The running step's StepContext (None during warm-up), set and cleared around one compiled call: an op inside a
# compiled graph takes tensors and numbers only, so the step's block tables and cache reach `attend` this way (as
# vLLM's forward context does), the one place the engine keeps such a context.
_step = threading.local()
_INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Inductor's cache under tandem's: a new name whenever the graphs' shape constraints change, so that no artifact
# compiled under the old ones is read ("inductor" held graphs bounded by each engine's max_batch).
INDUCTOR_FOLDER = "inductor-2"
MAX_GRAPH_TOKENS = 1 << 16  # the token count every compiled graph is traced for, at most


@dataclass(frozen=True)
class StepContext:
    meta: AttentionMetadata
    kv_cache: PagedKVCache
    on_layer: Callable[[int], None] | None
    paged: PagedStep | None  # where every layer's attention is the paged kernel: its shared arguments


def compile_mode(setting: bool | str | None) -> str:
    """"on", "off" or "background" (CPU: eager steps until a thread has compiled the step): the config's setting,
    or where it is None, TANDEM_COMPILE (on, off or background; default on). TANDEM_COMPILE=off turns a
    "background" setting off too (the setting says how to compile, the variable whether: a machine that should not
    compile at all, a test suite's). Raises ValueError for another value, as TANDEM_KERNEL_TUNING does."""
    value = os.environ.get(COMPILE_ENV, "on").strip().lower() or "on"
    if value not in ("on", "off", "background"):
        raise ValueError(f"{COMPILE_ENV} must be on, off or background, got {os.environ[COMPILE_ENV]!r}")
    if setting == "background" and value == "off":
        return "off"
    return value if setting is None else {True: "on", False: "off"}.get(setting, setting)


def compile_enabled(setting: bool | str | None) -> bool:
    """Whether the decode step is compiled at all (now or in the background): compile_mode's answer is not off."""
    return compile_mode(setting) != "off"


class BackgroundCompile:
    """compile_decode run in a thread while the engine serves eager: `assign(compiled)` is called with its result
    (the compiled step, or None where it failed, as compile_decode logs), and `done` is set after it."""

    def __init__(self, compile: Callable[[], CompiledDecode | None], assign: Callable[[CompiledDecode | None], None]):
        self.done = threading.Event()
        self.seconds: float | None = None

        def run() -> None:
            start = time.perf_counter()
            _lower_priority()
            try:
                assign(compile())
            finally:
                self.seconds = time.perf_counter() - start
                self.done.set()

        self._thread = threading.Thread(target=run, name="tandem-compile-decode", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


def register_projection(projection: Callable) -> int:
    handle = next(_handles)
    _projections[handle] = projection
    return handle


# The ops are defined with torch.library.Library rather than the custom_op decorator: its dispatch costs about 2 us
# less per call, and a step makes five calls per layer.
_library = torch.library.Library("tandem", "DEF")
_library.define("project(Tensor x, int handle) -> Tensor")
_library.define("attend(Tensor q, Tensor k, Tensor v, int model, int layer) -> Tensor")


def project(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _projections[handle](x)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: int, layer: int) -> torch.Tensor:
    """The model's attention for one layer of the running step: writes k/v to its cache, returns [T, Hq * D].
    During warm-up (no step) it returns zeros and touches nothing."""
    step = getattr(_step, "context", None)
    if step is None:
        return q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    if step.paged is not None:  # the kernel itself: about 10 us a layer less than the backend's forward
        return step.paged(q, k, v, step.kv_cache.layer(layer), layer).view(q.shape[0], -1)
    return _models[model].attend(layer, q, k, v, step.meta, step.kv_cache, step.on_layer)


_library.impl("project", project, "CPU")
_library.impl("attend", attend, "CPU")


@torch.library.register_fake("tandem::project", lib=_library)
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _projections[handle].out_features)


@torch.library.register_fake("tandem::attend", lib=_library)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: int, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class CompiledOps:
    """What the model's layer loop calls for products and attention when it is traced: the custom ops above."""

    def __init__(self, model_handle: int):
        self.model_handle = model_handle

    @staticmethod
    def project(projection, x: torch.Tensor) -> torch.Tensor:
        if getattr(projection, "traceable", False):
            return projection(x)
        return torch.ops.tandem.project(x, projection.compile_handle)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.tandem.attend(q, k, v, self.model_handle, layer)


def why_not_compiled(model: LlamaModel) -> str | None:
    """Why this model's decode step cannot be compiled here, or None if it can."""
    if model.device.type not in ("cpu", "cuda"):
        return f"the compiled step runs on the CPU and on CUDA ({model.device.type} runs eager)"
    if model.comm is not None:
        return "the replica spans processes (the compiled step is for a whole model in one process)"
    if any(not isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        return "MoE layers route tokens by data, which the compiled step does not trace"
    return None


class CompiledDecode:
    """The model's decode step compiled for 1..max_batch sequences. Build it with `compile_decode`."""

    def __init__(self, model: LlamaModel, max_batch: int, max_query_len: int = 1):
        self.max_batch = max_batch
        # The graph computes tokens whatever sequence they belong to (attention reads the step's metadata outside
        # it): a speculating sequence's few tokens run in it too.
        self.max_query_len = max_query_len
        self.compiles = 0  # graphs inductor compiled (one per bucket after warm-up)
        self.fallbacks = 0  # steps run eager because they would have needed another compilation
        handle = next(_handles)
        _models[handle] = model
        self._model = model
        for projection in model.projections():  # a projection keeps its handle: graphs compiled earlier hold it
            if not hasattr(projection, "compile_handle"):
                projection.compile_handle = register_projection(projection)
        ops = CompiledOps(handle)

        def layers(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model.run_layers(input_ids, positions, None, ops)

        # Dynamo keeps compiled graphs per code object, and every instance's `layers` would share one: give each its
        # own, so that its cache holds exactly its two buckets (and the guards that tell them apart are the only
        # ones a step checks, skip_guard_eval_unsafe below) however many models a process compiles.
        code = layers.__code__.replace(co_name=f"decode_step_{handle}")
        layers = types.FunctionType(code, layers.__globals__, code.co_name, None, layers.__closure__)
        self._fn = torch.compile(layers, backend=self._backend, fullgraph=True)
        self.steps = 0  # decode steps run compiled
        self._warned = False

    @property
    def buckets(self) -> str:
        """The batch sizes compiled, in words."""
        return "1" if self.max_batch == 1 else f"1 and 2-{self.max_batch}"

    @property
    def kind(self) -> str:
        return "compiled"

    def _backend(self, graph: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        return compile_fx(graph, example_inputs)

    def warm_up(self) -> float:
        """Compiles every bucket (1, and 2..max_batch when max_batch > 1). Returns the seconds it took. Raises
        what compilation raises."""
        start = time.perf_counter()
        sizes = [1] if self.max_batch == 1 else [1, 2]
        with torch.inference_mode():
            for size in sizes:
                ids = torch.zeros(size, dtype=torch.int64)
                positions = torch.zeros(size, dtype=torch.int64)
                if size > 1:
                    # One bound for every graph, not max_batch: a graph compiled for "2..N" carries the guard
                    # "<= N", and a later compilation for another N that finds it in inductor's cache fails on it
                    # (measured: 16, then 64). Calls above max_batch never reach the graph (LlamaModel.forward).
                    torch._dynamo.mark_dynamic(ids, 0, min=2, max=MAX_GRAPH_TOKENS)
                    torch._dynamo.mark_dynamic(positions, 0, min=2, max=MAX_GRAPH_TOKENS)
                self._fn(ids, positions)
        return time.perf_counter() - start

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: PagedKVCache, on_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        """The step's hidden states, or None if it needs a graph warm-up did not compile (the caller runs it
        eager)."""
        paged = self._model.paged_step(meta, kv_cache) if on_layer is None else None
        _step.context = StepContext(meta, kv_cache, on_layer, paged)
        try:
            # Guards: only those that differ between this step's two graphs (the batch size) are checked; what the
            # others check (the model and its weights) does not change after warm-up.
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
                out = self._fn(input_ids, positions)
            self.steps += 1
            return out
        except RuntimeError as e:
            if "recompil" not in str(e).lower():
                raise
            self.fallbacks += 1
            if not self._warned:
                self._warned = True
                _log.warning("compiled decode step: a batch of %d sequences needs a graph warm-up did not compile; "
                             "such steps run eager (%s)", input_ids.shape[0], str(e).splitlines()[0])
            return None
        finally:
            _step.context = None


BACKGROUND_NICE = 10  # the compiling thread's niceness above the engine's: its steps come first on a shared core


def _lower_priority() -> None:
    """This thread (and the compiler processes it starts, which inherit it) at BACKGROUND_NICE more niceness
    (Linux schedules threads by their own niceness); elsewhere, or where it is refused, nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


def _use_inductor_cache(folder: Path) -> None:
    """Points inductor's cache at `folder` unless the user chose one: inductor writes its own default into
    TORCHINDUCTOR_CACHE_DIR the first time it looks, so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(_INDUCTOR_CACHE_ENV)
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ[_INDUCTOR_CACHE_ENV] = str(folder)


def compile_decode(model: LlamaModel, max_batch: int, max_query_len: int = 1, *, kv_quantized: bool = False,
                   kv_cache: PagedKVCache | None = None,
                   max_blocks: int | None = None) -> CompiledDecode | CudaGraphDecode | None:
    """The model's compiled decode step, warmed up for 1..max_batch sequences (on CUDA: its CUDA graphs, captured);
    None (eager) where it cannot be compiled or compilation fails, with the reason logged. max_query_len > 1: on the
    CPU, steps whose sequences add up to that many tokens each (speculation) run compiled too, up to
    max_batch * max_query_len tokens. kv_quantized: the KV cache is int8 / fp8, whose writes size their work from
    the data (blocks whose scale grows), which a CUDA graph cannot capture: on CUDA the step then runs eager.
    kv_cache, max_blocks (on CUDA): the cache the steps write and the most blocks a sequence can hold
    (decode_bucket.blocks_per_sequence), which full CUDA graphs (attention inside) need; without them the graphs
    are piecewise. The CPU ignores them. With them, warm-up runs a step over block 0 of kv_cache and restores it:
    call this before the cache holds anything another thread may read or write."""
    reason = why_not_compiled(model)
    if reason is None and kv_quantized and model.device.type == "cuda":
        reason = "CUDA graphs cannot capture the quantized KV cache's writes (their work depends on the data)"
    if reason is not None:
        _log.info("decode step runs eager: %s", reason)
        return None
    if model.device.type == "cuda":
        return _capture_cuda_graphs(model, max_batch, kv_cache, max_blocks)
    _use_inductor_cache(cache_root() / INDUCTOR_FOLDER / machine_digest(model.cpu, torch.get_num_threads()))
    try:
        compiled = CompiledDecode(model, max_batch * max_query_len, max_query_len)  # warm_up compiles
        _log.info("compiling the decode step for %s sequences (the first time on this machine takes about half a "
                  "minute per bucket; later starts read %s)", compiled.buckets, os.environ[_INDUCTOR_CACHE_ENV])
        seconds = compiled.warm_up()
    except Exception as e:  # noqa: BLE001 - any compiler failure leaves the model eager, which is always correct
        _log.warning("decode step runs eager: compilation failed: %s: %s", type(e).__name__, " ".join(str(e).split()))
        return None
    _log.info("compiled the decode step for %s sequences in %.1f s", compiled.buckets, seconds)
    return compiled


def _capture_cuda_graphs(model: LlamaModel, max_batch: int, kv_cache: PagedKVCache | None,
                         max_blocks: int | None) -> CudaGraphDecode | None:
    from tandem.engine.models.cuda_graphs import CudaGraphDecode

    try:
        graphs = CudaGraphDecode(model, max_batch, kv_cache=kv_cache, max_blocks=max_blocks)
        _log.info("capturing the decode step's CUDA graphs for %s sequences", graphs.buckets)
        seconds = graphs.warm_up()
    except Exception as e:  # noqa: BLE001 - any capture failure leaves the model eager, which is always correct
        _log.warning("decode step runs eager: CUDA graph capture failed: %s: %s", type(e).__name__,
                     " ".join(str(e).split()))
        return None
    _log.info("captured the decode step as %s for %s sequences in %.1f s", graphs.kind, graphs.buckets, seconds)
    return graphs


def decode_step_summary(model: LlamaModel, enabled: bool, compiled: CompiledDecode | CudaGraphDecode | None,
                        background: bool = False) -> str:
    """How a rank runs decode steps, for the replica's ready line: compiled (or as CUDA graphs) for which batch
    sizes, or eager and why."""
    if background:
        return "eager until the step compiled in the background is ready"
    if compiled is not None:
        return f"{compiled.kind} ({compiled.buckets} sequences)"
    if not enabled:
        return "eager (compile off)"
    reason = why_not_compiled(model)
    return f"eager ({reason or 'compilation failed; the replica log says why'})"
