"""The engine on an NVIDIA GPU against the CPU, on the embedded model: bfloat16 on CUDA (the default there) keeps
float32's next-token distribution within the bounds the CPU's bfloat16 paths are held to (tests/engine/
test_int4.py), float32 on CUDA gives the CPU's greedy tokens, and so does a tp=2 replica over two GPUs (NCCL).
Attention runs on the Triton kernels (attention_backend auto on CUDA).

The GPU tests run only on a machine with CUDA (`make test-gpu`) and are skipped elsewhere; the CPU-side
precondition of the greedy comparisons runs everywhere."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.loader import load_model
from tandem.engine.parallel import ParallelConfig
from tandem.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import Completion, run_all
from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NUM_TOKENS = 16
# Prompts whose float32 greedy continuation never has a near-tie in its first NUM_TOKENS tokens: the top two
# log-probabilities of every step differ by more than 0.06 on the CPU (measured), far above the ~1e-5 by which a
# GPU's float32 sums differ from the CPU's. test_cpu_margins_leave_room_for_rounding re-checks it.
GREEDY_TEXTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Water boils at",
                "import numpy as np\n", "The mitochondria is"]
MIN_MARGIN = 0.02  # nats; what the greedy comparison needs, with room to spare


def greedy_run(engine: LLMEngine, prompts: list[list[int]], logprobs: int | None = None) -> list[Completion]:
    """Every prompt at once (one batch), NUM_TOKENS greedy tokens each."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, params)
    done = run_all(engine)
    return [done[(f"p{i}", 0)] for i in range(len(prompts))]


def engine_config() -> EngineConfig:
    return EngineConfig(num_kv_blocks=192, max_model_len=1024)


@pytest.fixture(scope="module")
def greedy_prompts(embedded) -> list[list[int]]:
    return [embedded.tokenizer.encode(text) for text in GREEDY_TEXTS]


@pytest.fixture(scope="module")
def cpu_greedy(embedded, greedy_prompts) -> list[Completion]:
    """The CPU float32 engine's tokens, with the top-2 log-probabilities of each step."""
    return greedy_run(LLMEngine(embedded, engine_config()), greedy_prompts, logprobs=2)


@pytest.fixture(scope="module")
def cuda_float32():
    return load_model(progress=False, device="cuda", dtype=torch.float32)


@pytest.mark.gpu
@NEEDS_CUDA
def test_bfloat16_on_cuda_stays_close_to_float32_on_the_cpu(embedded_generator):
    """Same top token and KL(float32 CPU || bfloat16 CUDA) < 0.02 nats on every parity prompt, the bounds of
    test_int4.py::test_bfloat16_models_stay_close_to_float32."""
    from tandem.engine.core.generator import Generator

    loaded = load_model(progress=False, device="cuda", dtype=torch.bfloat16)
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16
    generator = Generator(loaded, max_model_len=2048)
    assert generator.loaded.model.attention.choice.name == "triton"  # auto: Triton on CUDA
    for name, spec in PROMPTS.items():
        ids = _prompt_ids(loaded.tokenizer, spec)
        reference = embedded_generator.prompt_logits(ids).float().cpu().log_softmax(-1)
        logprobs = generator.prompt_logits(ids).float().cpu().log_softmax(-1)
        assert int(logprobs.argmax()) == int(reference.argmax()), name
        kl = (reference.exp() * (reference - logprobs)).sum().item()
        assert kl < 0.02, (name, kl)
    generator.block_pool.check_integrity()
    assert generator.block_pool.num_free == generator.block_pool.num_blocks


def test_cpu_margins_leave_room_for_rounding(cpu_greedy):
    """The precondition of the greedy comparisons below, checked on the CPU (it needs no GPU): no step of the
    CPU's continuation is a near-tie, so a different summation order on the GPU cannot flip a token."""
    for text, completion in zip(GREEDY_TEXTS, cpu_greedy):
        assert len(completion.logprobs) == NUM_TOKENS
        margins = [lp.top_logprobs[0][1] - lp.top_logprobs[1][1] for lp in completion.logprobs]
        assert min(margins) > MIN_MARGIN, (text, margins)


@pytest.mark.gpu
@NEEDS_CUDA
def test_float32_on_cuda_gives_the_cpu_greedy_tokens(cuda_float32, greedy_prompts, cpu_greedy):
    engine = LLMEngine(cuda_float32, engine_config())
    assert engine.rank_placements[0].device.startswith("cuda")
    assert cuda_float32.model.attention.choice.name == "triton"
    on_gpu = greedy_run(engine, greedy_prompts)
    for text, gpu, cpu in zip(GREEDY_TEXTS, on_gpu, cpu_greedy):
        assert gpu.token_ids == cpu.token_ids, (text, gpu.text, cpu.text)
        assert gpu.text == cpu.text
    assert engine.stats().num_blocks_in_use == 0


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_over_two_gpus_gives_the_single_gpu_greedy_tokens(cuda_float32, greedy_prompts):
    reference = greedy_run(LLMEngine(cuda_float32, engine_config()), greedy_prompts)
    meta = load_model(weights=False, progress=False, device="cuda", dtype=torch.float32)  # the ranks load shards
    with LLMEngine(meta, engine_config(), parallel=ParallelConfig(tp=2)) as engine:
        assert sorted(p.device for p in engine.rank_placements) == ["cuda:0", "cuda:1"]  # one GPU per rank
        split = greedy_run(engine, greedy_prompts)
        assert engine.stats().num_blocks_in_use == 0
    for text, tp2, tp1 in zip(GREEDY_TEXTS, split, reference):
        assert tp2.token_ids == tp1.token_ids, (text, tp2.text, tp1.text)
