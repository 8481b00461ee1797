"""The compiled decode step (engine/models/compiled.py): greedy output identical to eager, every graph compiled at
start-up and none on a request, and eager wherever it cannot compile."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.loader import load_model
from tandem.engine.models.compiled import (INDUCTOR_FOLDER, compile_decode, compile_enabled, compile_mode,
                                           decode_step_summary, why_not_compiled)
from tandem.engine.models.step import run_step
from tandem.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import run_all
from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids
from tests.engine.tiny_models import write_tiny_model

NUM_TOKENS = 32


def _greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int = NUM_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    done = run_all(engine)
    return [done[(f"r{i}", 0)].token_ids for i in range(len(prompts))]


def _engine(loaded, compile_step: bool, max_num_seqs: int = 4) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=256, max_num_seqs=max_num_seqs, compile=compile_step,
                                          enable_prefix_caching=False))


@pytest.mark.slow
def test_greedy_output_is_eager_output_on_the_parity_prompts(embedded):
    """All seven parity prompts at once, four sequences at a time: the decode batches shrink and grow between 1 and
    4 as prompts finish and join, so both buckets run. Slow (make test-all): compiling the embedded model's 30
    layers from an empty cache takes about 70 s on 2 cores; test_tiny_models_compiled_equal_eager shows the same
    on the tiny checkpoints in make test, both buckets included."""
    prompts = [_prompt_ids(embedded.tokenizer, spec) for _, spec in sorted(PROMPTS.items())]
    with _engine(embedded, False) as eager:
        assert eager.executor.runner.compiled is None
        assert eager.rank_placements[0].decode_step == "eager (compile off)"
        expected = _greedy(eager, prompts)
    with _engine(embedded, True) as engine:
        compiled = engine.executor.runner.compiled
        assert compiled is not None and compiled.compiles == 2  # warm-up: one sequence, and 2-4
        assert engine.rank_placements[0].decode_step == "compiled (1 and 2-4 sequences)"
        assert _greedy(engine, prompts) == expected
        assert compiled.steps > 0  # decode steps ran compiled ...
        assert compiled.compiles == 2 and compiled.fallbacks == 0  # ... and none needed a new graph
        engine.check_integrity()


@pytest.fixture(scope="module", params=["qwen3", "mistral_sliding_window"])
def tiny(request, embedded, tmp_path_factory):
    """Per-head query/key norms (qwen3), a sliding window shorter than the generated text (mistral)."""
    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_model(folder, request.param, embedded.tokenizer)
    return load_model(folder, progress=False)


def test_tiny_models_compiled_equal_eager(tiny):
    """Five prompts, four sequences at a time: four decode together (the 2-4 graph), then the fifth alone (the
    one-sequence graph)."""
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 30, 9, 12)]
    with _engine(tiny, False) as eager:
        expected = _greedy(eager, prompts, 40)
    with _engine(tiny, True) as engine:
        compiled = engine.executor.runner.compiled
        assert _greedy(engine, prompts, 40) == expected
        assert compiled.steps > 0 and compiled.compiles == 2 and compiled.fallbacks == 0


def test_compiled_in_the_background_the_engine_serves_at_once(tiny, monkeypatch):
    """compile: background starts the engine without the compiled step and serves eager while a thread compiles
    it; the steps after it is ready run compiled, and the output is eager's throughout."""
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 30, 9, 12)]
    with _engine(tiny, False) as eager:
        expected = _greedy(eager, prompts, 40)
    monkeypatch.setenv("TANDEM_COMPILE", "on")  # (the suite's off would turn background off)
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=4, compile="background", enable_prefix_caching=False)
    with LLMEngine(tiny, config) as engine:
        runner = engine.executor.runner
        assert engine.rank_placements[0].decode_step == "eager until the step compiled in the background is ready"
        assert _greedy(engine, prompts, 40) == expected  # eager, compiled, or first one then the other
        assert runner.background_compile.wait(600) and runner.background_compile.seconds > 0
        compiled = runner.compiled
        assert compiled is not None and compiled.compiles == 2
        steps = compiled.steps
        assert _greedy(engine, prompts, 40) == expected
        assert compiled.steps > steps and compiled.fallbacks == 0


def test_the_background_compile_runs_below_the_engine():
    """The compiling thread (and the compiler processes it starts) runs at BACKGROUND_NICE more niceness than the
    engine's thread, so that on a shared core the steps served meanwhile come first; its result is assigned."""
    import threading

    from tandem.engine.models.compiled import BACKGROUND_NICE, BackgroundCompile

    seen, assigned = {}, []

    def compile_step():
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return "step"

    job = BackgroundCompile(compile_step, assigned.append)
    assert job.wait(60) and assigned == ["step"] and job.seconds >= 0
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["nice"] == min(19, here + BACKGROUND_NICE)


def test_a_batch_without_a_warmed_up_graph_runs_eager(tiny, caplog):
    """Warmed up for one sequence only, a step of two is not compiled on the request: it runs eager (the caller's
    fallback), with a warning."""
    from tandem.engine.attention import AttentionMetadata
    from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

    model = tiny.model
    compiled = compile_decode(model, max_batch=1)
    assert compiled is not None and compiled.compiles == 1
    kv = PagedKVCache(KVCacheSpec(len(model.layers), 4, 16, model.num_kv_heads, model.config.head_dim, model.dtype))
    meta = AttentionMetadata.build([1, 1], [3, 3], [[0], [1]], 16, torch.device("cpu"))
    ids, positions = torch.tensor([5, 6]), torch.tensor([3, 3])
    with caplog.at_level(logging.WARNING, logger="tandem.engine.models.compiled"), torch.inference_mode():
        assert compiled(ids, positions, meta, kv, None) is None
        out = run_step(model, ids, positions, meta, kv, compiled=compiled)  # eager, through the same entry point
    assert out.shape == (2, model.config.hidden_size) and torch.isfinite(out).all()
    assert compiled.compiles == 1 and compiled.fallbacks == 1  # forward did not even try: 2 > max_batch
    assert "needs a graph warm-up did not compile" in caplog.text


def test_a_decode_step_calls_the_paged_kernel_itself(tiny, monkeypatch):
    """Where the backend runs the paged kernel, the compiled step calls it with the step's shared arguments
    (PagedStep), never through the backend; the outputs and the cache written are eager's. A quantized cache,
    which the kernel does not read, goes through the backend's gather. (The backend's functions are counted at
    module level: patching its class would fail the graph's guards.)"""
    from tandem.engine.attention import AttentionMetadata, cpu_decode, torch_ref
    from tandem.engine.attention.cpu_decode import PagedStep
    from tandem.engine.hardware.cpu_kernels import library_error
    from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

    if library_error() is not None:
        pytest.skip(f"tandem's CPU kernels do not run here: {library_error()}")
    model = tiny.model
    compiled = compile_decode(model, max_batch=2)
    calls = {}

    def count(owner, name):
        fn = getattr(owner, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(owner, name, call)

    count(PagedStep, "__call__")
    count(cpu_decode, "paged_decode")
    count(torch_ref, "decode_kernel")
    meta = AttentionMetadata.build([1, 1], [20, 7], [[0, 1], [2]], 16, torch.device("cpu"))
    with torch.inference_mode():  # as the engine's steps are (warm-up's graphs are for inference tensors)
        ids, positions = torch.tensor([5, 6]), torch.tensor([19, 6])
    for kv_dtype, takes in ((model.dtype, True), (torch.int8, False)):
        spec = KVCacheSpec(len(model.layers), 4, 16, model.num_kv_heads, model.config.head_dim, kv_dtype)
        kv, eager_kv = PagedKVCache(spec), PagedKVCache(spec)
        if takes:  # earlier tokens' keys and values to attend to (a quantized cache's stay zeros, scales too)
            kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(0)))
            eager_kv.data.copy_(kv.data)
        calls.update({"__call__": 0, "paged_decode": 0, "decode_kernel": 0})
        with torch.inference_mode():
            out = compiled(ids, positions, meta, kv, None)
            layers = len(model.layers)
            assert calls == {"__call__": layers if takes else 0, "paged_decode": 0,
                             "decode_kernel": 0 if takes else layers}, kv_dtype
            assert compiled.steps == (1 if takes else 2)
            expected = model.forward(ids, positions, meta, eager_kv)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        if takes:  # (a quantized cache's codes and scale bytes may round the other way: its outputs are compared)
            torch.testing.assert_close(kv.data, eager_kv.data, rtol=1e-5, atol=1e-5)  # fused rotary: not bitwise


def test_compilation_failure_leaves_the_engine_eager(tiny, monkeypatch, caplog):
    import torch._inductor.compile_fx as compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    torch._dynamo.reset()  # forget graphs compiled earlier in this process
    with caplog.at_level(logging.WARNING, logger="tandem.engine.models.compiled"):
        with _engine(tiny, True) as engine:
            assert engine.executor.runner.compiled is None
            assert engine.rank_placements[0].decode_step.startswith("eager (compilation failed")
            monkeypatch.undo()
            prompts = [list(range(10, 20))]
            got = _greedy(engine, prompts, 8)
    assert "decode step runs eager: compilation failed" in caplog.text and "no C++ compiler here" in caplog.text
    with _engine(tiny, False) as eager:
        assert got == _greedy(eager, prompts, 8)


def test_what_is_not_compiled_says_why(embedded, tmp_path):
    write_tiny_model(tmp_path, "mixtral", embedded.tokenizer)
    moe = load_model(tmp_path, progress=False).model
    assert "MoE" in why_not_compiled(moe)
    assert compile_decode(moe, 4) is None
    assert decode_step_summary(moe, True, None).startswith("eager (MoE layers")
    assert why_not_compiled(embedded.model) is None


def test_the_setting(monkeypatch):
    monkeypatch.delenv("TANDEM_COMPILE", raising=False)
    assert compile_enabled(None) is True
    monkeypatch.setenv("TANDEM_COMPILE", "off")
    assert compile_enabled(None) is False and compile_enabled(True) is True
    monkeypatch.setenv("TANDEM_COMPILE", "on")
    assert compile_enabled(False) is False
    monkeypatch.setenv("TANDEM_COMPILE", "background")
    assert compile_mode(None) == "background" and compile_enabled(None) is True
    assert compile_mode(True) == "on" and compile_mode(False) == "off" and compile_mode("background") == "background"
    monkeypatch.setenv("TANDEM_COMPILE", "off")  # whether to compile at all: a background setting too
    assert compile_mode("background") == "off" and compile_mode(True) == "on"
    monkeypatch.setenv("TANDEM_COMPILE", "no")  # a typo must not silently compile (or not)
    with pytest.raises(ValueError, match="TANDEM_COMPILE must be on, off or background"):
        compile_enabled(None)


CHECK_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from tandem.engine.attention import AttentionMetadata
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.loader import load_model
from tandem.engine.models.compiled import compile_decode
from tandem.engine.models.step import run_step
model = load_model(sys.argv[1], progress=False).model
compiled = compile_decode(model, max_batch=1)
assert compiled is not None
kv = PagedKVCache(KVCacheSpec(len(model.layers), 4, 16, model.num_kv_heads, model.config.head_dim, model.dtype))
with torch.inference_mode():
    prompt = AttentionMetadata.build([7], [0], [[2]], 16, torch.device("cpu"))
    model.forward(torch.arange(10, 17), torch.arange(7), prompt, kv)
    step = AttentionMetadata.build([1], [7], [[2]], 16, torch.device("cpu"))
    ids, positions = torch.tensor([20]), torch.tensor([7])
    eager = model.forward(ids, positions, step, kv)
    out = run_step(model, ids, positions, step, kv, compiled=compiled)
assert compiled.steps == 1
torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
import json
from tandem.engine.hardware.kernel_tuning import machine_key
print(json.dumps(machine_key(model.cpu, torch.get_num_threads())))
"""


def test_the_compiled_cache_is_kept_per_cpu_capability(embedded, tmp_path):
    """Inductor's own cache key leaves out torch's CPU capability: code cached by an AVX-512 process and loaded by
    an AVX2 one (ATEN_CPU_CAPABILITY=avx2, as on a shared home directory) computed NaN. tandem keeps one inductor
    cache per machine key, so each process here compiles its own code and matches eager.

    One process runs as it is, the other capped at AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2). The
    machine key holds torch's capability and the oneDNN cap, so the two never share a folder, on any CPU, for a
    reason that depends on the CPU:
      - AVX-512: the capabilities differ (AVX512 against AVX2), and so do the oneDNN caps;
      - AVX2 only (no avx512f flag): both processes run AVX2 code, and only the oneDNN cap tells them apart. Two
        folders are still right there: the kernel timings in the same key depend on oneDNN's ISA, and a cap
        that changes nothing on this CPU costs one more compilation, never a wrong answer."""
    import json
    import subprocess
    import sys

    write_tiny_model(tmp_path / "model", "llama3", embedded.tokenizer)
    source = str(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY",
                                                             "ONEDNN_MAX_CPU_ISA")}
    env |= {"TANDEM_CACHE_DIR": str(tmp_path / "cache"), "TANDEM_KERNEL_TUNING": "off"}
    keys = []
    for extra in ({}, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}):
        done = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, source], env=env | extra, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        keys.append(json.loads(done.stdout.splitlines()[-1]))
    native, capped = keys
    assert capped["capability"] == "AVX2" and capped["onednn_max_isa"] == "AVX2"
    assert native["onednn_max_isa"] == ""
    differ = {field for field in native if native[field] != capped[field]}
    if "avx512f" in native["flags"]:
        assert native["capability"].startswith("AVX512")
        # the oneDNN probes (bfloat16 kernels) may differ too: the capped process has no AVX-512 for them
        assert {"capability", "onednn_max_isa"} <= differ <= {"capability", "onednn_max_isa", "features"}
    else:
        assert native["capability"] == "AVX2"
        assert differ == {"onednn_max_isa"}
    assert len(list((tmp_path / "cache" / INDUCTOR_FOLDER).iterdir())) == 2


def test_a_cache_folder_the_user_chose_is_kept(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from tandem.engine.models.compiled import _use_inductor_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    _use_inductor_cache(tmp_path / "ours")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ours")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes when it looks first
    _use_inductor_cache(tmp_path / "ours")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ours")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    _use_inductor_cache(tmp_path / "ours")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")
