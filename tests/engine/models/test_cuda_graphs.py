"""The decode step as piecewise CUDA graphs (engine/models/cuda_graphs.py): greedy tokens identical to eager on the
GPU, every bucket captured at start-up and none on a request, eager where no bucket holds a batch. The bucket
arithmetic is checked on any machine; the rest needs a CUDA GPU (marked gpu, skipped without one)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.loader import load_model
from tandem.engine.models.cuda_graphs import CudaGraphDecode, batch_buckets, bucket_for
from tests.engine.models.test_compiled import _greedy
from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]


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
def test_greedy_tokens_from_graphs_are_eager_tokens_on_the_parity_prompts(cuda_model, max_num_seqs):
    """All seven parity prompts, one at a time (bucket 1, no padding) or eight at a time (batches of 7 down to 1
    as prompts finish: padded to 8, 4 and 2), against the same engine eager on the same GPU."""
    prompts = [_prompt_ids(cuda_model.tokenizer, spec) for _, spec in sorted(PROMPTS.items())]
    with _engine(cuda_model, False, max_num_seqs) as eager:
        assert eager.executor.runner.compiled is None
        expected = _greedy(eager, prompts)
    with _engine(cuda_model, True, max_num_seqs) as engine:
        graphs = engine.executor.runner.compiled
        assert isinstance(graphs, CudaGraphDecode)
        assert graphs.compiles == len(batch_buckets(max_num_seqs))
        assert engine.rank_placements[0].decode_step == f"CUDA graphs ({graphs.buckets} sequences)"
        got = _greedy(engine, prompts)
        diverged = {i: next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)
                    for i, (g, e) in enumerate(zip(got, expected)) if g != e}
        assert not diverged, f"prompt -> first differing token: {diverged}"
        assert graphs.steps > 0 and graphs.fallbacks == 0  # decode steps replayed graphs, none needed a capture
        assert graphs.compiles == len(batch_buckets(max_num_seqs))
        engine.check_integrity()


@pytest.mark.gpu
def test_a_batch_larger_than_every_bucket_is_left_to_eager(cuda_model):
    graphs = CudaGraphDecode(cuda_model.model, 2)
    graphs.warm_up()
    ids = torch.zeros(3, dtype=torch.int64, device="cuda")
    assert graphs(ids, ids.clone(), None, None, None) is None  # returns before it reads the step
    assert graphs.fallbacks == 1 and graphs.steps == 0 and graphs.compiles == 2
