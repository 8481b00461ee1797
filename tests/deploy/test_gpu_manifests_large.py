"""deploy/manifests/gpu-llama3-70b.yaml and gpu-mixtral-8x22b.yaml as `tandem validate` and `tandem up` see them,
on the CPU: each validates against the weight-free folder `tandem make-model --like` writes for its model (the
published config.json) with load_format: dummy, describes the splits, SLOs and replica bounds its comments promise, and the
engine's layout of those splits holds what the comments say each GPU holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tandem.cluster.cli import main
from tandem.cluster.manifest_checks import validate_file
from tandem.cluster.manifest_yaml import ManifestInvalid
from tandem.cluster.replica_plans import replica_plans
from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout

from tests.deploy.model_shapes import LLAMA3_70B, MIXTRAL_8X22B, make_model_like, manifest_with_model, num_params

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "manifests"
KEY = "sk-test-gpu-large-0123456789"


@pytest.fixture(autouse=True)
def _load_embedded_once(embedded_shape_once):
    """validate_file loads the embedded model's shape once for the session (tests/conftest.py)."""


@pytest.fixture(scope="module")
def llama3_70b(tmp_path_factory) -> Path:
    return make_model_like("Meta-Llama-3-70B-Instruct", tmp_path_factory.mktemp("models") / "Meta-Llama-3-70B-Instruct")


@pytest.fixture(scope="module")
def mixtral_8x22b(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "Mixtral-8x22B-Instruct-v0.1"
    return make_model_like("Mixtral-8x22B-Instruct-v0.1", folder)


def with_model(tmp_path: Path, name: str, model: Path) -> Path:
    """A copy of deploy/manifests/<name> whose `model:` line names model, loaded with dummy weights."""
    text = (MANIFESTS / name).read_text()
    assert yaml.safe_load(text)["model"] == f"/models/{model.name}"  # the placeholder names the same model
    path = tmp_path / name
    path.write_text(manifest_with_model(text, model, dummy=True))
    return path


def layout(config: dict, tp: int = 1, pp: int = 1, ep: int = 1) -> ReplicaLayout:
    return ReplicaLayout.build(ParallelConfig(tp=tp, pp=pp, ep=ep), num_layers=config["num_hidden_layers"],
                               num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                               num_experts=config.get("num_local_experts", 0))


def check_common(manifest, model: Path) -> None:
    """What both manifests share: disaggregated on `ray up`'s cluster, one GPU per rank in bfloat16, each pool on
    its own custom resource (deploy/ray/*.yaml advertise them), autoscaled between 1 and 4 replicas, open to the
    network behind an API key."""
    assert manifest.model_path == str(model) and manifest.mode == "disaggregated"
    assert manifest.ray.address == "auto"
    assert manifest.slo.ttft_s is not None and manifest.slo.itl_s is not None
    for name, pool in manifest.pool_items():
        assert pool.resources.gpus == 1 and pool.resources.custom == {f"tandem_{name}": 1}
        assert (pool.device, pool.dtype, pool.engine.block_size) == ("cuda", "bfloat16", 16)
        assert (pool.replicas.min, pool.replicas.max, pool.replicas.start) == (1, 4, 1)
        assert pool.autoscaling.resource_timeout_s >= 1800  # Ray's autoscaler launches a GPU node meanwhile
        assert pool.parallelism.world_size == 8  # one replica fills an 8-GPU node
    assert manifest.listen.grpc == "0.0.0.0:50051" and manifest.listen.http == "0.0.0.0:8000"
    assert manifest.auth.resolve() == {KEY: "default"}

    plans = replica_plans(manifest)
    assert [p.name for p in plans] == ["prefill-0", "decode-0"]
    assert [p.bundle for p in plans] == [{"CPU": 64, "GPU": 8, "tandem_prefill": 8},
                                         {"CPU": 64, "GPU": 8, "tandem_decode": 8}]
    assert all(p.spec.model == str(model.resolve()) and p.spec.dtype == "bfloat16" for p in plans)
    assert all(p.spec.load_format == "dummy" for p in plans)


def test_llama3_70b_prefill_tp8_and_decode_tp4_x_pp2(tmp_path, llama3_70b, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", KEY)  # the manifest's key_env
    manifest = validate_file(with_model(tmp_path, "gpu-llama3-70b.yaml", llama3_70b), check_ports=False)
    check_common(manifest, llama3_70b)
    prefill, decode = manifest.pools.prefill, manifest.pools.decode
    assert (prefill.parallelism.tp, prefill.parallelism.pp, prefill.parallelism.ep) == (8, 1, 1)
    assert (decode.parallelism.tp, decode.parallelism.pp, decode.parallelism.ep) == (4, 2, 1)
    assert prefill.engine.max_model_len == decode.engine.max_model_len == 8192  # the model's whole context

    # What the comments say each GPU holds: prefill 1 KV head (8 query heads) of all 80 layers; decode 40 layers
    # and 2 KV heads (16 query heads).
    for shard in map(layout(LLAMA3_70B, tp=8).shard, range(8)):
        assert (len(shard.layers), len(shard.kv_heads), len(shard.q_heads)) == (80, 1, 8)
    for shard in map(layout(LLAMA3_70B, tp=4, pp=2).shard, range(8)):
        assert (len(shard.layers), len(shard.kv_heads), len(shard.q_heads)) == (40, 2, 16)


def test_mixtral_8x22b_prefill_tp8_and_decode_ep8(tmp_path, mixtral_8x22b, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", KEY)
    manifest = validate_file(with_model(tmp_path, "gpu-mixtral-8x22b.yaml", mixtral_8x22b), check_ports=False)
    check_common(manifest, mixtral_8x22b)
    prefill, decode = manifest.pools.prefill, manifest.pools.decode
    assert (prefill.parallelism.tp, prefill.parallelism.pp, prefill.parallelism.ep) == (8, 1, 1)
    assert (decode.parallelism.tp, decode.parallelism.pp, decode.parallelism.ep) == (1, 1, 8)
    assert prefill.engine.max_model_len == decode.engine.max_model_len == 32768  # half the model's 64k

    # Prefill: 1 KV head (6 query heads) and a slice of every expert; decode: one whole expert of each of the 56
    # layers and all of attention (the 8 KV heads) on every rank.
    for shard in map(layout(MIXTRAL_8X22B, tp=8).shard, range(8)):
        assert (len(shard.layers), len(shard.kv_heads), len(shard.q_heads), len(shard.experts)) == (56, 1, 6, 8)
    for rank, shard in enumerate(map(layout(MIXTRAL_8X22B, ep=8).shard, range(8))):
        assert (len(shard.layers), len(shard.kv_heads), len(shard.q_heads), shard.experts) == (56, 8, 48, (rank,))


def test_the_shaped_folders_have_the_published_dims(llama3_70b, mixtral_8x22b):
    from tandem.engine.loader import load_model_info

    llama = load_model_info(llama3_70b).config
    assert (llama.num_layers, llama.hidden_size, llama.num_heads, llama.num_kv_heads) == (80, 8192, 64, 8)
    assert (llama.intermediate_size, llama.vocab_size, llama.max_position_embeddings) == (28672, 128256, 8192)
    assert llama.head_dim == 128 and llama.rope.theta == 500000 and llama.eos_token_ids == (128009,)
    assert llama.moe is None and not llama.tie_word_embeddings

    mixtral = load_model_info(mixtral_8x22b).config
    assert mixtral.architecture == "MixtralForCausalLM"
    assert (mixtral.num_layers, mixtral.hidden_size, mixtral.num_heads, mixtral.num_kv_heads) == (56, 6144, 48, 8)
    assert (mixtral.vocab_size, mixtral.max_position_embeddings, mixtral.head_dim) == (32768, 65536, 128)
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (8, 2, 16384)
    assert mixtral.rope.theta == 1000000 and mixtral.sliding_windows == (None,) * 56
    assert (mixtral.bos_token_id, mixtral.eos_token_ids) == (1, (2,))

    # The parameter counts the model cards give (70.6B, 141B): the weights the comments size per GPU.
    assert num_params(LLAMA3_70B) == 70_553_706_496
    assert round(num_params(MIXTRAL_8X22B) / 1e9) == 141


@pytest.mark.parametrize("name", ["gpu-llama3-70b.yaml", "gpu-mixtral-8x22b.yaml"])
def test_without_the_api_key_in_the_environment_a_large_manifest_is_refused(name, tmp_path, llama3_70b,
                                                                            mixtral_8x22b, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    model = llama3_70b if "llama" in name else mixtral_8x22b
    with pytest.raises(ManifestInvalid) as info:
        validate_file(with_model(tmp_path, name, model), check_ports=False)
    [error] = info.value.errors
    assert error.path == "auth.api_keys.0" and "TANDEM_API_KEY" in error.message


@pytest.mark.parametrize(("name", "decode", "says"), [
    ("gpu-llama3-70b.yaml", {"ep": 8}, "ep=8 needs a mixture-of-experts model"),
    ("gpu-mixtral-8x22b.yaml", {"ep": 16}, "ep=16 is more than the model's 8 experts"),
    ("gpu-mixtral-8x22b.yaml", {"tp": 2, "pp": 64}, "pp=64 is more than the model's 56 layers"),
], ids=["llama-has-no-experts", "mixtral-has-8-experts", "mixtral-has-56-layers"])
def test_a_split_the_model_cannot_take_is_refused(name, decode, says, tmp_path, llama3_70b, mixtral_8x22b,
                                                  monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", KEY)
    path = with_model(tmp_path, name, llama3_70b if "llama" in name else mixtral_8x22b)
    data = yaml.safe_load(path.read_text())
    data["pools"]["decode"]["parallelism"] = decode
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ManifestInvalid) as info:
        validate_file(path, check_ports=False)
    [error] = info.value.errors
    assert error.path == "pools.decode.parallelism" and says in error.message


def test_tandem_validate_prints_the_splits(tmp_path, llama3_70b, mixtral_8x22b, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_API_KEY", KEY)
    for name, model, decode in (("gpu-llama3-70b.yaml", llama3_70b, "decode 4x2x1"),
                                ("gpu-mixtral-8x22b.yaml", mixtral_8x22b, "decode 1x1x8")):
        path = with_model(tmp_path, name, model)
        assert main(["validate", "--no-port-check", str(path)]) == 0
        out = capsys.readouterr()
        assert f"{path}: valid (disaggregated; prefill 8x1x1 (tp x pp x ep) x 1 replica(s), {decode}" in out.out
        assert "prefill and decode on dummy weights (load_format: dummy): answers are noise)" in out.out
        assert out.err == ""  # no warning: the open ports are behind an API key
