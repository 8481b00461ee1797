"""Weights are read lazily: a rank of a tp/pp/ep replica reads from the files only its own tensors and slices
(never another stage's layers or another EP index's experts), straight into its dtype, and builds exactly the
model that eagerly read float32 tensors give.

Reads are counted where the file is read (each LazyTensor's fetch), in the bytes the file stores. Ranks are
built in this process, as engine/runner/ranks/worker.py builds them, with a stand-in for ParallelComm: construction
only asks it for the layout; no collective runs here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engine.errors import ModelLoadError
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.loader import default_model_path, load_checkpoint
from tandem.engine.loader.lazy_tensor import LazyTensor
from tandem.engine.model_config import ModelConfig
from tandem.engine.models import LlamaModel, build_model
from tandem.engine.models.llama import check_weights, expected_shapes, expert_names, router_name
from tandem.engine.parallel import ParallelConfig, ReplicaLayout
from tandem.engine.parallel.layout import RankShard
from tandem.engine.runner.model_runner import ModelRunner, SequenceChunk
from tests.engine.tiny_models import write_tiny_model


@dataclasses.dataclass
class LayoutOnlyComm:
    """What LlamaModel's constructor reads of ParallelComm."""

    layout: ReplicaLayout

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def ep_size(self) -> int:
        return self.layout.ep


Reads = dict[str, list[tuple[tuple[int, ...], torch.dtype]]]


def spy_on_reads(weights: dict) -> Reads:
    """Wraps the fetch of every LazyTensor in `weights` (in place); returns, per tensor name, the shape and dtype
    of every part read from the file since."""
    reads: Reads = defaultdict(list)
    for name, value in weights.items():
        assert isinstance(value, LazyTensor), name

        def fetch(rows, columns, name=name, real=value.fetch):
            part = real(rows, columns)
            reads[name].append((tuple(part.shape), part.dtype))
            return part

        weights[name] = dataclasses.replace(value, fetch=fetch)
    return reads


def elements_read(reads: Reads) -> dict[str, int]:
    return {name: sum(math.prod(shape) for shape, _ in parts) for name, parts in reads.items()}


def bytes_read(reads: Reads) -> int:
    return sum(math.prod(shape) * dtype.itemsize for parts in reads.values() for shape, dtype in parts)


def shard_elements(config: ModelConfig, layout: ReplicaLayout, shard: RankShard) -> dict[str, int]:
    """Elements of each tensor the rank needs: its layers; of each, its query/KV heads' rows of Q/K/V (and
    biases), their columns of O, its share of each MLP's columns (of its experts only); the embedding on the
    first stage (and the last, when tied), the final norm and LM head on the last."""
    assert not config.qk_norm and not config.mlp_bias and not config.o_bias, "not counted here"
    h, d = config.hidden_size, config.head_dim
    q, kv = len(shard.q_heads) * d, len(shard.kv_heads) * d

    def mlp(names: tuple[str, str, str], size: int) -> dict[str, int]:
        columns = len(layout.columns(size, shard.tp_index))
        return {f"{n}.weight": columns * h for n in names}

    need: dict[str, int] = {}
    for n in shard.layers:
        a = f"model.layers.{n}.self_attn."
        need |= {f"model.layers.{n}.input_layernorm.weight": h, f"model.layers.{n}.post_attention_layernorm.weight": h,
                 a + "q_proj.weight": q * h, a + "k_proj.weight": kv * h, a + "v_proj.weight": kv * h,
                 a + "o_proj.weight": h * q}
        if config.qkv_bias:
            need |= {a + "q_proj.bias": q, a + "k_proj.bias": kv, a + "v_proj.bias": kv}
        moe = config.moe
        if moe is not None and moe.sparse_layers[n]:
            assert not moe.shared_intermediate_size, "not counted here"
            need[router_name(config, n)] = moe.num_experts * h
            for e in shard.experts:
                need |= mlp(expert_names(config, n, e), moe.intermediate_size)
        else:
            need |= mlp(expert_names(config, n, None), config.intermediate_size)
    if shard.is_first_stage or (shard.is_last_stage and config.tie_word_embeddings):
        need["model.embed_tokens.weight"] = config.vocab_size * h
    if shard.is_last_stage:
        need["model.norm.weight"] = h
        if not config.tie_word_embeddings:
            need["lm_head.weight"] = config.vocab_size * h
    return need


def is_projection(name: str) -> bool:
    """A tensor that tensor parallelism splits (attention, MLP and expert weights, Q/K/V biases)."""
    return "_proj." in name or ".experts." in name


def build_rank(config: ModelConfig, weights: dict, parallel: ParallelConfig, rank: int,
               dtype: torch.dtype = torch.float32) -> LlamaModel:
    layout = ReplicaLayout.build(parallel, num_layers=config.num_layers, num_heads=config.num_heads,
                                 num_kv_heads=config.num_kv_heads, num_experts=config.num_experts)
    comm = LayoutOnlyComm(layout) if layout.world_size > 1 else None
    return build_model(config, weights, dtype=dtype, shard=layout.shard(rank), comm=comm)


def eager_float32(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder read in full and widened to float32: what the loader returned before."""
    return {k: v.float() for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def model_tensors(model: LlamaModel) -> list[torch.Tensor]:
    """Every tensor a (rank's) model holds, in a fixed order."""
    out = [t for t in (model.embed, model.norm) if t is not None]
    for layer in model.layers:
        out += [layer.input_norm, layer.post_norm]
    for p in model.projections():
        out += [p.dense_weight()] + ([] if p.bias is None else [p.bias])
    return out


@pytest.fixture(scope="module")
def folders(embedded, tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lazy")
    made = {kind: write_tiny_model(root / kind, kind, embedded.tokenizer) for kind in ("qwen2", "mixtral")}
    return made | {"llama3": tiny_llama.source}


LAYOUTS = [("llama3", ParallelConfig(tp=2)), ("qwen2", ParallelConfig(tp=2)), ("llama3", ParallelConfig(pp=2)),
           ("mixtral", ParallelConfig(ep=2)), ("mixtral", ParallelConfig(tp=2, ep=2))]


@pytest.mark.parametrize("kind, parallel", LAYOUTS, ids=[f"{k}-tp{p.tp}-pp{p.pp}-ep{p.ep}" for k, p in LAYOUTS])
def test_each_rank_reads_only_its_own_tensors_and_slices(folders, kind, parallel):
    """Every rank reads exactly its shard's elements, each tensor once; other stages' layers and other EP
    indices' experts are never read. Over the replica each expert is read once and every other split tensor
    once per EP index (attention is replicated over them), so a tp=2 rank reads half of the attention and
    MLP bytes."""
    config = load_checkpoint(folders[kind], progress=False).config
    per_rank = []
    for rank in range(parallel.world_size):
        checkpoint = load_checkpoint(folders[kind], progress=False)
        reads = spy_on_reads(checkpoint.weights)
        model = build_rank(config, checkpoint.weights, parallel, rank)
        assert all(len(parts) == 1 for parts in reads.values()), "a tensor was read twice"
        assert elements_read(reads) == shard_elements(config, model.comm.layout, model.shard)
        unread = set(checkpoint.weights)  # build_model pops what the rank holds
        assert not unread & set(reads)
        per_rank.append(elements_read(reads))

    whole = {name: math.prod(shape) for name, shape in expected_shapes(config).items()}
    over_ranks: dict[str, int] = defaultdict(int)
    for reads in per_rank:
        for name, n in reads.items():
            over_ranks[name] += n
    for name, n in whole.items():
        if ".experts." in name:
            assert over_ranks[name] == n, name  # on one EP index, split over its TP ranks
        elif is_projection(name):
            assert over_ranks[name] == n * parallel.ep, name
        else:
            assert over_ranks[name] >= n, name  # norms, router, embedding: whole on every rank that needs them
    if parallel.tp == 2 and parallel.pp == parallel.ep == 1:
        split = sum(n for name, n in whole.items() if is_projection(name))
        assert [sum(n for name, n in r.items() if is_projection(name)) for r in per_rank] == [split // 2] * 2
    if parallel.pp == 2:
        layers = [{int(name.split(".")[2]) for name in r if name.startswith("model.layers.")} for r in per_rank]
        assert layers == [{0, 1}, {2}]


def test_experts_of_other_ep_indices_are_never_read(folders):
    """EP index 1 of 2 holds experts 4-7 of the tiny Mixtral: it reads them, and experts 0-3 stay in the
    checkpoint unread."""
    checkpoint = load_checkpoint(folders["mixtral"], progress=False)
    config = checkpoint.config
    reads = spy_on_reads(checkpoint.weights)
    build_rank(config, checkpoint.weights, ParallelConfig(ep=2), rank=1)
    expert_of = {name: int(name.split(".experts.")[1].split(".")[0]) for name in expected_shapes(config)
                 if ".experts." in name}
    assert {expert_of[name] for name in reads if name in expert_of} == {4, 5, 6, 7}
    assert {expert_of[name] for name in checkpoint.weights if name in expert_of} == {0, 1, 2, 3}  # left unread


SPLIT = [("llama3", ParallelConfig(tp=2)), ("qwen2", ParallelConfig(tp=2)), ("mixtral", ParallelConfig(tp=2, ep=2))]


@pytest.mark.parametrize("kind, parallel", SPLIT, ids=[kind for kind, _ in SPLIT])
def test_lazily_read_rank_holds_the_same_tensors_as_one_built_from_eager_float32(folders, kind, parallel):
    """Each part read already sliced gives every rank the very norms, projection weights and biases that whole
    float32 tensors, sliced in memory, give."""
    config = load_checkpoint(folders[kind], progress=False).config
    for rank in range(parallel.world_size):
        lazy = build_rank(config, load_checkpoint(folders[kind], progress=False).weights, parallel, rank)
        eager = build_rank(config, eager_float32(folders[kind]), parallel, rank)
        for a, b in zip(model_tensors(lazy), model_tensors(eager), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    spec = KVCacheSpec(model.config.num_layers, 8, 16, model.config.num_kv_heads, model.config.head_dim, model.dtype)
    return ModelRunner(model, PagedKVCache(spec)).execute([SequenceChunk(tuple(ids), 0, tuple(range(8)))])[0]


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mixtral"])
def test_lazily_read_model_gives_the_logits_of_eager_float32_weights(folders, kind, embedded):
    ids = embedded.tokenizer.encode("Lazy weights must change nothing: the quick brown fox jumps over the dog.")
    checkpoint = load_checkpoint(folders[kind], progress=False)
    lazy = _logits(build_model(checkpoint.config, checkpoint.weights), ids)
    eager = _logits(build_model(checkpoint.config, eager_float32(folders[kind])), ids)
    torch.testing.assert_close(lazy, eager, rtol=0, atol=0)


@pytest.fixture(scope="module")
def bf16_folder(folders, tmp_path_factory) -> Path:
    """The tiny Llama 3 stored in bfloat16 (as most published checkpoints are)."""
    source, folder = folders["llama3"], tmp_path_factory.mktemp("bf16")
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, folder / path.name,
                      metadata={"format": "pt"})
        elif path.is_file():
            shutil.copy(path, folder / path.name)
    return folder


def test_bfloat16_weights_are_read_as_stored_and_never_widened(bf16_folder, embedded):
    """A bfloat16 rank reads its slices as the file stores them (2 bytes a weight, half the bytes of its
    float32 twin) and holds bfloat16 tensors; its logits are those of eagerly read weights."""
    checkpoint = load_checkpoint(bf16_folder, progress=False)
    config = checkpoint.config
    reads = spy_on_reads(checkpoint.weights)
    model = build_rank(config, checkpoint.weights, ParallelConfig(tp=2), rank=0, dtype=torch.bfloat16)
    assert {dtype for parts in reads.values() for _, dtype in parts} == {torch.bfloat16}
    assert bytes_read(reads) == 2 * sum(shard_elements(config, model.comm.layout, model.shard).values())
    assert {t.dtype for t in model_tensors(model)} == {torch.bfloat16}

    whole = build_model(config, load_checkpoint(bf16_folder, progress=False).weights, dtype=torch.bfloat16)
    eager = build_model(config, eager_float32(bf16_folder), dtype=torch.bfloat16)
    assert {t.dtype for t in model_tensors(whole)} == {torch.bfloat16}
    ids = embedded.tokenizer.encode("Stored in bfloat16, computed in bfloat16.")
    torch.testing.assert_close(_logits(whole, ids), _logits(eager, ids), rtol=0, atol=0)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_a_missing_tensor_is_reported_before_anything_is_read(folders):
    checkpoint = load_checkpoint(folders["llama3"], progress=False)
    del checkpoint.weights["model.layers.1.mlp.up_proj.weight"]
    reads = spy_on_reads(checkpoint.weights)
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' is missing \(the config "
                                             r"needs it\)"):
        build_model(checkpoint.config, checkpoint.weights, source=str(checkpoint.source))
    assert not reads


def test_a_wrong_shape_is_reported_before_anything_is_read(folders, tmp_path):
    folder = shutil.copytree(folders["llama3"], tmp_path / "edited")
    _edit_config(folder, intermediate_size=192)
    checkpoint = load_checkpoint(folder, progress=False)
    reads = spy_on_reads(checkpoint.weights)
    with pytest.raises(ModelLoadError, match=r"mlp.gate_proj.weight' has shape \(160, 64\) but the config implies "
                                             r"\(192, 64\)"):
        check_weights(checkpoint.config, checkpoint.weights, str(folder))
    with pytest.raises(ModelLoadError, match=r"has shape \(160, 64\)"):
        build_rank(checkpoint.config, checkpoint.weights, ParallelConfig(tp=2), rank=0)
    assert not reads


def test_a_tensor_that_cannot_be_read_names_its_file(folders, tmp_path):
    folder = shutil.copytree(folders["llama3"], tmp_path / "gone")
    checkpoint = load_checkpoint(folder, progress=False)
    lazy = checkpoint.weights["model.norm.weight"]
    broken = dataclasses.replace(lazy, fetch=dataclasses.replace(lazy.fetch, key="model.norm.missing"))
    with pytest.raises(ModelLoadError, match=r"safetensors: tensor 'model.norm.missing' cannot be read"):
        broken.read(dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="rows range\\(0, 65\\)"):
        lazy.read(range(0, 65), dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def gguf_checkpoint():
    return load_checkpoint(default_model_path(), progress=False)


@pytest.mark.parametrize("name, rows, columns", [
    ("model.layers.3.self_attn.q_proj.weight", range(384, 576), None),  # rows permuted by llama.cpp: 3 of 9 heads
    ("model.layers.3.self_attn.k_proj.weight", range(0, 128), None),
    ("model.layers.3.mlp.gate_proj.weight", range(768, 1536), None),  # cut before dequantizing
    ("model.layers.3.mlp.down_proj.weight", None, range(768, 1536)),
    ("model.norm.weight", range(0, 576), None),
])
def test_gguf_slices_are_the_slices_of_the_whole_tensor(gguf_checkpoint, name, rows, columns):
    lazy = gguf_checkpoint.weights[name]
    whole = lazy.materialize()
    part = lazy.read(rows, columns, dtype=torch.bfloat16, device="cpu")
    expected = whole if rows is None else whole[rows.start:rows.stop]
    expected = expected if columns is None else expected[:, columns.start:columns.stop]
    assert part.dtype == torch.bfloat16
    torch.testing.assert_close(part, expected.to(torch.bfloat16), rtol=0, atol=0)


def test_gguf_tp2_rank_reads_only_its_slices():
    """The embedded SmolLM2 (9 query / 3 KV heads, tied embedding) at tp=2: rank 1 holds query heads 6-8 and KV
    head 2, and reads just those rows and its half of the MLP columns (dequantized on the way)."""
    checkpoint = load_checkpoint(default_model_path(), progress=False)
    config = checkpoint.config
    reads = spy_on_reads(checkpoint.weights)
    model = build_rank(config, checkpoint.weights, ParallelConfig(tp=2), rank=1)
    assert model.shard.q_heads == range(6, 9) and model.shard.kv_heads == range(2, 3)
    assert elements_read(reads) == shard_elements(config, model.comm.layout, model.shard)
    projections = sum(math.prod(s) for name, s in expected_shapes(config).items() if is_projection(name))
    read = sum(n for name, n in elements_read(reads).items() if is_projection(name))
    assert read < 0.55 * projections
