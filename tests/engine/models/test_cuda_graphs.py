"""The decode step as CUDA graphs (engine/models/cuda_graphs.py), full (attention inside) or piecewise: greedy tokens
identical to eager on the GPU (in float32; in bfloat16 up to a near-tie: BF16_TIE), every bucket captured at
start-up and none on a request, piecewise where full graphs do not apply or fail to capture, eager where no bucket
holds a batch. The bucket arithmetic and when full graphs apply are checked on any machine (the full graph's body
on the CPU: test_decode_bucket.py); the rest needs a CUDA GPU (marked gpu, skipped without one)."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.engine.attention import AttentionMetadata, TorchAttentionBackend
from tandem.engine.attention.triton_backend import TritonAttentionBackend
from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.loader import load_model
from tandem.engine.models import cuda_graphs
from tandem.engine.models.cuda_graphs import CudaGraphDecode, batch_buckets, bucket_for, why_not_full
from tandem.engine.models.decode_bucket import BucketShape, DecodeInputs, run_body
from tandem.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import run_all
from tests.engine.models.test_compiled import NUM_TOKENS, _greedy
from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]
# In bfloat16 a graph's decode kernel splits the keys by its bucket's fixed table width where eager splits by the
# batch's, so attention sums in another order and a logit can round to its neighbouring bfloat16 value (0.125 apart
# at magnitudes 16-32). On the H200 (2026-11-28) one of seven prompts took the other token at step 17 of 32. So in
# bfloat16 greedy tokens may part only where eager's top two log-probabilities were within this many nats.
BF16_TIE = 0.25


def test_buckets_double_to_eight_then_step_by_eight_and_end_at_the_largest_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(128)[-3:] == [112, 120, 128] and len(batch_buckets(128)) == 19
    with pytest.raises(ValueError, match="at least 1"):
        batch_buckets(0)


def test_a_batch_replays_the_smallest_bucket_that_holds_it():
    buckets = batch_buckets(20)
    assert [bucket_for(buckets, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 20)] == [1, 2, 4, 8, 8, 16, 16, 20, 20]
    assert bucket_for(buckets, 21) is None


def test_graphs_refuse_a_model_off_the_gpu(embedded):
    with pytest.raises(ValueError, match="need a CUDA device"):
        CudaGraphDecode(embedded.model, 4)


def test_full_graphs_need_the_triton_backend_the_cache_and_its_width(tiny_llama):
    model = tiny_llama.model
    c = model.config
    kv = PagedKVCache(KVCacheSpec(c.num_layers, 4, 16, model.num_kv_heads, c.head_dim, model.dtype))
    int8 = PagedKVCache(KVCacheSpec(c.num_layers, 4, 16, model.num_kv_heads, c.head_dim, torch.int8))
    assert "full graphs need the Triton backend" in why_not_full(model, kv, 8)  # the torch reference
    try:
        model.attention = TritonAttentionBackend()
        assert why_not_full(model, kv, 8) is None
        assert "were not given" in why_not_full(model, None, 8) and "were not given" in why_not_full(model, kv, None)
        assert "quantized KV cache" in why_not_full(model, int8, 8)
    finally:
        model.attention = TorchAttentionBackend()


def _engine(loaded, compile_step: bool, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=256, max_num_seqs=max_num_seqs, compile=compile_step,
                                          enable_prefix_caching=False))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def cuda_model(request):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    return load_model(progress=False, device="cuda", dtype=request.param)


@pytest.mark.parametrize("max_num_seqs", [1, 8], ids=["batch1", "batches2-7padded"])
@pytest.mark.gpu
def test_greedy_tokens_from_full_graphs_are_eager_tokens_on_the_parity_prompts(cuda_model, max_num_seqs):
    """All seven parity prompts, one at a time (bucket 1, no padding) or eight at a time (batches of 7 down to 1
    as prompts finish: padded to 8, 4 and 2), against the same engine eager on the same GPU: each decode step one
    replay of its bucket's full graph, attention included."""
    prompts = [_prompt_ids(cuda_model.tokenizer, spec) for _, spec in sorted(PROMPTS.items())]
    tie = BF16_TIE if cuda_model.model.dtype == torch.bfloat16 else 0.0
    with _engine(cuda_model, False, max_num_seqs) as eager:
        assert eager.executor.runner.compiled is None
        expected, margins = _greedy_with_margins(eager, prompts)
    with _engine(cuda_model, True, max_num_seqs) as engine:
        graphs = engine.executor.runner.compiled
        assert isinstance(graphs, CudaGraphDecode) and graphs.full, graphs.why_piecewise
        assert graphs.compiles == len(batch_buckets(max_num_seqs))
        assert engine.rank_placements[0].decode_step == f"CUDA graphs, full ({graphs.buckets} sequences)"
        got = _greedy(engine, prompts)
        _assert_same_tokens(got, expected, margins, tie)
        assert graphs.steps > 0 and graphs.fallbacks == 0  # decode steps replayed graphs, none ran eager
        assert graphs.compiles == len(batch_buckets(max_num_seqs))  # none captured on a request
        engine.check_integrity()


@pytest.mark.gpu
def test_a_failed_full_capture_falls_back_to_piecewise_graphs_with_eager_tokens(cuda_model, monkeypatch, caplog):
    prompts = [_prompt_ids(cuda_model.tokenizer, spec) for _, spec in sorted(PROMPTS.items())]
    tie = BF16_TIE if cuda_model.model.dtype == torch.bfloat16 else 0.0
    with _engine(cuda_model, False, 8) as eager:
        expected, margins = _greedy_with_margins(eager, prompts)

    def fail(*args):
        raise RuntimeError("forced for the test")

    monkeypatch.setattr(cuda_graphs, "run_body", fail)
    with caplog.at_level(logging.WARNING, logger="tandem.engine.models.cuda_graphs"), \
            _engine(cuda_model, True, 8) as engine:
        graphs = engine.executor.runner.compiled
        assert isinstance(graphs, CudaGraphDecode) and not graphs.full
        assert graphs.why_piecewise == "full capture failed: RuntimeError: forced for the test"
        assert "run piecewise: full capture failed" in caplog.text
        assert engine.rank_placements[0].decode_step == f"CUDA graphs, piecewise ({graphs.buckets} sequences)"
        _assert_same_tokens(_greedy(engine, prompts), expected, margins, tie)
        assert graphs.steps > 0 and graphs.fallbacks == 0 and graphs.compiles == len(batch_buckets(8))


@pytest.mark.gpu
def test_a_replayed_full_graph_is_its_body_and_padding_writes_nothing_else(cuda_model):
    """Three sequences in bucket 4: the replay gives what the body gives run eagerly on the same inputs, and the
    cache differs from before the step only at the three sequences' slots. Warm-up leaves the cache as it was."""
    model = cuda_model.model
    model.attention = TritonAttentionBackend()
    c = model.config
    kv = PagedKVCache(KVCacheSpec(c.num_layers, 32, 16, model.num_kv_heads, c.head_dim, model.dtype), "cuda")
    kv.data.normal_()
    start = kv.data.clone()
    graphs = CudaGraphDecode(model, 4, kv_cache=kv, max_blocks=16)
    graphs.warm_up()
    assert graphs.full and graphs.compiles == 3 and torch.equal(kv.data, start)
    tables, lens = [[3, 7], [12], [20, 5, 9]], [20, 1, 40]
    meta = AttentionMetadata.build([1, 1, 1], [n - 1 for n in lens], tables, 16, torch.device("cuda"))
    ids = torch.tensor([5, 6, 7], device="cuda")
    positions = torch.tensor(lens, device="cuda") - 1
    with torch.inference_mode():
        out = graphs(ids, positions, meta, kv, None)
        replayed = kv.data.clone()
        kv.data.copy_(start)
        inputs = DecodeInputs(BucketShape.plan(4, 16, model.num_kv_heads), 16, "cuda")
        inputs.fill(ids, positions, meta)
        expected = run_body(model, inputs, kv)[:3]
    # The same kernels on the same inputs: equal, but for a few ulps should a library pick another algorithm.
    tol = 1e-4 if model.dtype == torch.float32 else 2e-2
    assert graphs.steps == 1 and torch.allclose(out.float(), expected.float(), rtol=tol, atol=tol)
    assert torch.allclose(replayed.float(), kv.data.float(), rtol=tol, atol=tol)
    written = torch.zeros(32 * 16, dtype=torch.bool, device="cuda")
    written[meta.slot_mapping] = True
    written = written.view(32, 16)[None, None, :, None, :, None]
    assert torch.equal(replayed.masked_fill(written, 0), start.masked_fill(written, 0))
    assert graphs(ids, positions, meta, kv, lambda layer: None) is None  # a layer observer: eager
    assert graphs.fallbacks == 1


def _greedy_with_margins(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and, per step, the gap between the top two log-probabilities."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    done = run_all(engine)
    runs = [done[(f"r{i}", 0)] for i in range(len(prompts))]
    return ([run.token_ids for run in runs],
            [[lp.top_logprobs[0][1] - lp.top_logprobs[1][1] for lp in run.logprobs] for run in runs])


def _assert_same_tokens(got: list[list[int]], expected: list[list[int]], margins: list[list[float]],
                        tie: float) -> None:
    """got equals expected, but that a prompt may part where expected's top-two margin was at most tie."""
    diverged = {i: next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)
                for i, (g, e) in enumerate(zip(got, expected)) if g != e}
    beyond_tie = {i: (j, round(margins[i][j], 4)) for i, j in diverged.items() if margins[i][j] > tie}
    assert not beyond_tie, f"prompt -> (first differing token, eager's top-two margin there): {beyond_tie}"
