"""LoRA adapters in the engine (engine/models/lora.py, engine/loader/lora_adapter.py): adapters made here with `peft`
on the embedded model (non-zero B, ranks 8, 16 and 64, different target modules), served unmerged, checked
against `transformers` + `peft` on the same weights: greedy tokens equal alone and in one batch of three adapters
plus the base model; the prefix cache keeps each adapter's KV its own; bad adapters and unknown names refused with
the reason."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.core.lora_registry import UnknownAdapterError
from tandem.engine.engine_config import EngineConfig, LoRAConfig
from tandem.engine.loader.lora_adapter import LoRAAdapterError, read_adapter
from tandem.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import run_all
from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids
from tests.reference import hf_greedy

NUM_TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, use_rslora, factor on peft's random B: large enough to change the output)
ADAPTERS = {"all8": (8, 16, ALL, False, 0.2), "attn64": (64, 128, ["q_proj", "v_proj", "o_proj"], False, 2.0),
            "mlp16": (16, 16, ["k_proj", "gate_proj", "up_proj", "down_proj"], True, 0.5)}


@pytest.fixture(scope="module")
def adapters(hf_embedded, tmp_path_factory):
    """{name: folder} of adapters saved by peft, and the peft model holding all of them (a copy of the reference:
    the session's is left as it was). B is random (peft's init_lora_weights=False), scaled so that each adapter
    changes the output and the adapted model still writes text."""
    from peft import LoraConfig, get_peft_model

    hf_model, _ = hf_embedded
    peft_model = None
    folders = {}
    root = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(0)
    for name, (rank, alpha, targets, rslora, factor) in ADAPTERS.items():
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                            use_rslora=rslora)
        if peft_model is None:
            peft_model = get_peft_model(copy.deepcopy(hf_model), config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if f"lora_B.{name}." in param_name:
                    param.mul_(factor)
        peft_model.save_pretrained(root / name, selected_adapters=[name])
        folders[name] = next((root / name).rglob("adapter_config.json")).parent
    peft_model.eval()
    return folders, peft_model


def _reference(peft_model, ids: list[int], adapter: str | None) -> list[int]:
    if adapter is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, ids, NUM_TOKENS)[0]
    peft_model.set_adapter(adapter)
    return hf_greedy(peft_model, ids, NUM_TOKENS)[0]


@pytest.fixture(scope="module")
def lora_engine(embedded, adapters):
    folders, _ = adapters
    engine = LLMEngine(embedded, EngineConfig(num_kv_blocks=256, lora=LoRAConfig(max_rank=64, max_loaded=3)))
    for name, folder in folders.items():
        assert engine.load_lora(name, str(folder)) < 1.0  # seconds to check it
    return engine


def _generate(engine: LLMEngine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    names = [f"q{engine.num_steps}-{i}" for i in range(len(requests))]
    for name, (ids, adapter) in zip(names, requests):
        engine.add_request(name, ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                     lora=adapter))
    done = run_all(engine)
    return [done[(name, 0)].token_ids for name in names]


@pytest.mark.reference
def test_each_adapter_alone_gives_transformers_and_peft_greedy_tokens(embedded, adapters, lora_engine):
    _, peft_model = adapters
    ids = _prompt_ids(embedded.tokenizer, PROMPTS["chat_short"])
    got = {name: _generate(lora_engine, [(ids, name)])[0] for name in [*ADAPTERS, None]}
    for name, tokens in got.items():
        assert tokens == _reference(peft_model, ids, name), name
    assert len({tuple(t) for t in got.values()}) == len(got)  # every adapter changes the output


@pytest.mark.reference
def test_a_batch_of_three_adapters_and_the_base_equals_each_alone(embedded, adapters, lora_engine):
    """Three prompts x (three adapters + base) in one batch, rows of one adapter interleaved with others'."""
    _, peft_model = adapters
    prompts = [_prompt_ids(embedded.tokenizer, spec) for _, spec in sorted(PROMPTS.items())][:3]
    requests = [(ids, name) for ids in prompts for name in [*ADAPTERS, None]]
    batched = _generate(lora_engine, requests)
    for (ids, name), tokens in zip(requests, batched):
        assert tokens == _reference(peft_model, ids, name), (name, ids[:8])
    assert lora_engine.executor.runner.lora.loads >= len(ADAPTERS)


def test_an_adapters_kv_is_its_own_in_the_prefix_cache(embedded, lora_engine):
    """The same prompt under two adapters and the base: no block hash in common (the adapter salts them), so
    the second adapter never reads the first one's KV; the same adapter again hits its own."""
    ids = _prompt_ids(embedded.tokenizer, PROMPTS["chat_long"])[::-1]  # a prompt no other test of the engine ran
    hashes = {}
    for name in ("all8", "mlp16", None):
        seq = lora_engine._sequence(f"h-{name}", ids, SamplingParams(lora=name), 0, None)
        hashes[name] = set(seq.block_hashes)
    assert hashes["all8"].isdisjoint(hashes["mlp16"]) and hashes["all8"].isdisjoint(hashes[None])
    _generate(lora_engine, [(ids, "all8")])
    before = lora_engine.scheduler.num_prompt_tokens_cached
    _generate(lora_engine, [(ids, "mlp16")])
    assert lora_engine.scheduler.num_prompt_tokens_cached == before
    _generate(lora_engine, [(ids, "all8")])
    assert lora_engine.scheduler.num_prompt_tokens_cached > before


def test_more_adapters_than_slots_wait_their_turn_with_the_same_tokens(embedded, adapters):
    """One slot: requests of three adapters run one adapter at a time (the scheduler holds the others back), each
    adapter loaded into the slot as its turn comes, every output as with three slots."""
    folders, _ = adapters
    ids = _prompt_ids(embedded.tokenizer, PROMPTS["chat_short"])
    outputs = {}
    for slots in (3, 1):
        engine = LLMEngine(embedded, EngineConfig(num_kv_blocks=128, lora=LoRAConfig(max_rank=64, max_loaded=slots)))
        for name, folder in folders.items():
            engine.load_lora(name, str(folder))
        outputs[slots] = _generate(engine, [(ids, name) for name in ADAPTERS for _ in range(2)])
        engine.check_integrity()
    assert outputs[1] == outputs[3]


def test_bad_adapters_and_unknown_names_are_refused_with_the_reason(embedded, adapters, tmp_path):
    folders, _ = adapters
    config = embedded.config
    with pytest.raises(LoRAAdapterError, match="over this replica's lora.max_rank"):
        read_adapter(folders["attn64"], "attn64", config, max_rank=16)
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is missing"):
        read_adapter(tmp_path, "none", config, 64)
    broken = tmp_path / "broken"
    broken.mkdir()
    settings = json.loads((folders["all8"] / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps(settings | {"use_dora": True}))
    with pytest.raises(LoRAAdapterError, match="use_dora is not served"):
        read_adapter(broken, "broken", config, 64)
    (broken / "adapter_config.json").write_text(json.dumps(settings))
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAAdapterError, match="cannot be read"):
        read_adapter(broken, "broken", config, 64)
    engine = LLMEngine(embedded, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        engine.load_lora("all8", str(folders["all8"]))
    with pytest.raises(UnknownAdapterError, match="no LoRA adapter named 'nope'"):
        engine.add_request("x", [1, 2, 3], SamplingParams(lora="nope"))
    assert not engine.has_unfinished_requests()


def test_an_adapter_in_use_cannot_be_unloaded_and_an_unloaded_one_is_refused(embedded, adapters):
    folders, _ = adapters
    engine = LLMEngine(embedded, EngineConfig(num_kv_blocks=64, lora=LoRAConfig(max_rank=64, max_loaded=1)))
    engine.load_lora("all8", str(folders["all8"]))
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=4, lora="all8"))
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        engine.unload_lora("all8")
    run_all(engine)
    engine.unload_lora("all8")
    with pytest.raises(UnknownAdapterError):
        engine.add_request("late", [1, 2, 3], SamplingParams(lora="all8"))
    with pytest.raises(UnknownAdapterError):
        engine.unload_lora("all8")


def test_tp2_ranks_hold_their_shard_of_each_adapter_and_give_one_process_tokens(embedded, adapters):
    """tensor parallelism over two rank processes: each rank reads its rows or columns of every adapter it is told
    of (with the step), and a batch of two adapters and the base model gives the one-process tokens."""
    from tandem.engine.parallel import ParallelConfig

    folders, _ = adapters
    ids = _prompt_ids(embedded.tokenizer, PROMPTS["chat_short"])
    requests = [(ids, "all8"), (ids, "mlp16"), (ids, None)]
    outputs = []
    for parallel in (ParallelConfig(), ParallelConfig(tp=2)):
        config = EngineConfig(num_kv_blocks=128, lora=LoRAConfig(max_rank=64, max_loaded=2))
        with LLMEngine(embedded, config, parallel=parallel) as engine:
            for name in ("all8", "mlp16"):
                engine.load_lora(name, str(folders[name]))
            outputs.append(_generate(engine, requests))
    assert outputs[1] == outputs[0]
    assert len({tuple(t) for t in outputs[0]}) == 3


def test_a_migrated_request_and_a_structured_one_keep_their_adapter(embedded, lora_engine):
    """A request resumed after the tokens another replica sent (migration) goes on as the adapter would; a choice
    constraint under an adapter answers one of the choices."""
    from tandem.engine.core.resume import ResumeState
    from tandem.engine.structured_output import StructuredOutput

    ids = _prompt_ids(embedded.tokenizer, PROMPTS["chat_short"])
    whole = _generate(lora_engine, [(ids, "all8")])[0]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, lora="all8")
    lora_engine.add_request("moved", ids, params, resume=ResumeState(tuple(whole[:5])))
    assert whole[:5] + run_all(lora_engine)[("moved", 0)].token_ids == whole
    choices = ["red", "green", "blue", "yellow"]
    picks = {}
    for adapter in ("all8", "attn64", None):
        lora_engine.add_request(f"pick-{adapter}", ids, SamplingParams(
            max_tokens=8, temperature=0, lora=adapter, structured=StructuredOutput.choice(choices)))
        picks[adapter] = run_all(lora_engine)[(f"pick-{adapter}", 0)].text
    assert set(picks.values()) <= set(choices), picks


def test_a_name_stays_bound_to_its_folder(embedded, adapters):
    """Cached KV is keyed by the adapter's name: loading the same folder again changes nothing, and another folder
    under a name served before (even after an unload) is refused."""
    folders, _ = adapters
    engine = LLMEngine(embedded, EngineConfig(num_kv_blocks=64, lora=LoRAConfig(max_rank=64, max_loaded=1)))
    assert engine.load_lora("x", str(folders["all8"])) > 0
    assert engine.load_lora("x", str(folders["all8"])) == 0.0
    engine.unload_lora("x")
    with pytest.raises(ValueError, match="'x' was served from .*all8"):
        engine.load_lora("x", str(folders["mlp16"]))
    assert engine.load_lora("x", str(folders["all8"])) > 0  # the same folder again, after its unload


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="LoRA on CUDA needs a CUDA GPU")
def test_adapters_on_cuda_in_float32_give_the_cpus_tokens_but_at_near_ties(embedded, adapters):
    """The same batch of three adapters and the base on CUDA (float32) and on the CPU: equal greedy tokens, except
    that a prompt may part where the CPU's top two log-probabilities were within 0.02 nats (sums in another order)."""
    from tandem.engine.loader import load_model

    folders, _ = adapters
    prompts = [_prompt_ids(embedded.tokenizer, spec) for _, spec in sorted(PROMPTS.items())][:3]
    requests = [(ids, name) for ids in prompts for name in [*ADAPTERS, None]]
    runs = {}
    for loaded in (embedded, load_model(progress=False, device="cuda", dtype=torch.float32)):
        config = EngineConfig(num_kv_blocks=256, lora=LoRAConfig(max_rank=64, max_loaded=3))
        with LLMEngine(loaded, config) as engine:
            for name, folder in folders.items():
                engine.load_lora(name, str(folder))
            for i, (ids, name) in enumerate(requests):
                engine.add_request(f"g{i}", ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                                lora=name, logprobs=2))
            done = run_all(engine)
            runs[loaded.device.type] = [done[(f"g{i}", 0)] for i in range(len(requests))]
    for cpu, cuda in zip(runs["cpu"], runs["cuda"]):
        step = next((j for j, (a, b) in enumerate(zip(cpu.token_ids, cuda.token_ids)) if a != b), None)
        if step is not None:
            top = cpu.logprobs[step].top_logprobs
            assert top[0][1] - top[1][1] < 0.02, (step, top)


def test_every_grouping_of_rows_adds_each_rows_own_adapter(embedded, tmp_path):
    """The three ways a step's rows reach the products (equal runs side by side in slots 0..n-1; runs of any length
    or in other slots; rows in any order, gathered) add to each row exactly its adapter's (x A^T) B^T scaled, and
    nothing to the base model's rows: checked on layer 0's fused QKV against the adapters' own tensors."""
    from tandem.engine.loader.lora_adapter import write_random_adapter
    from tandem.engine.models.lora import LoRASlots

    config, model = embedded.config, embedded.model
    weights = [read_adapter(write_random_adapter(tmp_path / f"a{i}", config, rank, seed=i, scale=0.5), f"a{i}",
                            config, 16) for i, rank in enumerate((16, 8, 4))]
    slots = LoRASlots(model, 4, 16)
    for slot, adapter in zip((0, 1, 3), weights):  # slot 2 left empty
        slots.load(slot, adapter)
    qkv = model.layers[0].qkv
    x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(0))
    q, kv = config.q_size, config.kv_size
    columns = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}

    def expected(slot_of_row: list[int]) -> torch.Tensor:
        out = torch.zeros(12, qkv.out_features)
        for row, slot in enumerate(slot_of_row):
            if slot >= 0:
                adapter = weights[(0, 1, None, 2)[slot]]
                for target, cols in columns.items():
                    a, b = adapter.modules[(0, target)]
                    out[row, cols] += (x[row] @ a.T) @ b.T * adapter.scaling
        return out

    cases = {"equal runs": [(-1, 3), (0, 3), (1, 3), (-1, 3)], "runs": [(3, 5), (-1, 2), (0, 1), (1, 4)],
             "gathered": [(1, 2), (0, 3), (1, 2), (-1, 1), (3, 4)]}
    for name, runs in cases.items():
        slots.set_rows(runs)
        kind = {"equal runs": slice, "runs": list, "gathered": torch.Tensor}[name]
        assert isinstance(slots._plan.rows, kind), name
        got = slots.add(qkv, x, torch.zeros(12, qkv.out_features))
        slot_of_row = [slot for slot, n in runs for _ in range(n)]
        assert torch.allclose(got, expected(slot_of_row), atol=1e-4), name
    slots.clear()
    assert not slots.active
