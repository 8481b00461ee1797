"""The GPU manifests (deploy/manifests/gpu-1.yaml, gpu-8.yaml) as `tandem validate` and `tandem up` see them, on
the CPU: both validate (gpu-8 against the folder `tandem make-model --like Meta-Llama-3-8B-Instruct` writes, config
and tokenizer without any weights, with load_format: dummy), and the replicas planned from them ask Ray for the GPUs the manifests' comments and the README say. A
replica split over several ranks cannot share a GPU, and device: cuda needs GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tandem.cluster.manifest_checks import validate_file
from tandem.cluster.manifest_yaml import ManifestInvalid
from tandem.cluster.replica_plans import replica_plans, resources_needed
from tests.deploy.model_shapes import make_model_like
from tests.deploy.model_shapes import manifest_with_model as replace_model

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "manifests"


@pytest.fixture(autouse=True)
def _load_embedded_once(embedded_shape_once):
    """validate_file loads the embedded model's shape once for the session (tests/conftest.py)."""


def manifest_with_model(tmp_path: Path, name: str, model: Path) -> Path:
    """A copy of deploy/manifests/<name> whose `model:` line names model instead, loaded with dummy weights."""
    path = tmp_path / name
    path.write_text(replace_model((MANIFESTS / name).read_text(), model, dummy=True))
    return path


@pytest.fixture
def llama3_8b(tmp_path, embedded_shape) -> Path:
    """`tandem make-model --like Meta-Llama-3-8B-Instruct` (its config.json, the embedded model's tokenizer, no
    weights) and the model's generation_config.json."""
    folder = make_model_like("Meta-Llama-3-8B-Instruct", tmp_path / "Meta-Llama-3-8B-Instruct")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 128000, "eos_token_id": [128001, 128009], "do_sample": True}))
    return folder


def test_gpu_1_shares_one_gpu_between_a_prefill_and_a_decode_replica():
    manifest = validate_file(MANIFESTS / "gpu-1.yaml", check_ports=False)
    assert manifest.mode == "disaggregated" and manifest.model_path is None  # embedded
    for _, pool in manifest.pool_items():
        assert pool.parallelism.world_size == 1
        assert pool.resources.gpus == 0.5 and pool.resources.cpus == 1
        assert pool.engine.device == "cuda" and (pool.device, pool.dtype) == ("cuda", "bfloat16")
        assert pool.engine.kv_cache_bytes == 4 << 30  # explicit: the two replicas share one GPU's memory
    assert manifest.listen.grpc == "127.0.0.1:50051" and manifest.listen.http == "127.0.0.1:8000"

    plans = replica_plans(manifest)
    assert [p.name for p in plans] == ["prefill-0", "decode-0"]
    assert [p.bundle["GPU"] for p in plans] == [0.5, 0.5]
    assert all(p.spec.device == "cuda" for p in plans)
    assert resources_needed(manifest)["GPU"] == 1.0  # `tandem up` starts a local Ray head with one GPU


def test_gpu_8_fills_an_8_gpu_node_with_a_llama3_8b_shaped_model(tmp_path, llama3_8b, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "sk-test-gpu-8-0123456789")  # the manifest's key_env
    manifest = validate_file(manifest_with_model(tmp_path, "gpu-8.yaml", llama3_8b), check_ports=False)
    assert manifest.model_path == str(llama3_8b)
    prefill, decode = manifest.pools.prefill, manifest.pools.decode
    assert (prefill.parallelism.tp, prefill.parallelism.pp, prefill.replicas.start) == (2, 1, 2)
    assert (decode.parallelism.tp, decode.parallelism.pp, decode.replicas.start) == (2, 2, 1)
    for pool in (prefill, decode):
        assert pool.resources.gpus == 1
        assert (pool.device, pool.dtype) == ("cuda", "bfloat16")
    assert manifest.listen.grpc == "0.0.0.0:50051" and manifest.listen.http == "0.0.0.0:8000"
    assert manifest.auth.resolve() == {"sk-test-gpu-8-0123456789": "default"}

    plans = replica_plans(manifest)
    assert [p.name for p in plans] == ["prefill-0", "prefill-1", "decode-0"]
    assert [p.bundle["GPU"] for p in plans] == [2, 2, 4]
    assert sum(p.bundle["GPU"] for p in plans) == 8 == resources_needed(manifest)["GPU"]
    assert all(p.spec.device == "cuda" and p.spec.dtype == "bfloat16" for p in plans)
    assert all(p.spec.model == str(llama3_8b.resolve()) and p.spec.load_format == "dummy" for p in plans)


def test_the_made_folder_has_llama3_8b_dims(llama3_8b):
    from tandem.engine.loader import load_model_info

    config = load_model_info(llama3_8b).config
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (4096, 32, 32, 8)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (14336, 128256, 8192)
    assert config.head_dim == 128 and config.rope.theta == 500000 and not config.tie_word_embeddings


def test_gpu_8_without_its_api_key_in_the_environment_is_refused(tmp_path, llama3_8b, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    with pytest.raises(ManifestInvalid) as info:
        validate_file(manifest_with_model(tmp_path, "gpu-8.yaml", llama3_8b), check_ports=False)
    [error] = info.value.errors
    assert error.path == "auth.api_keys.0" and "TANDEM_API_KEY" in error.message


def _mutated_gpu_1(tmp_path: Path, **decode) -> Path:
    data = yaml.safe_load((MANIFESTS / "gpu-1.yaml").read_text())
    for section, values in decode.items():
        data["pools"]["decode"][section] |= values
    path = tmp_path / "gpu-1-mutated.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("decode", [
    # Half a GPU for each of two ranks: the replica's one bundle asks for 1 GPU, but each rank's
    # CUDA_VISIBLE_DEVICES must name a whole device of its own.
    {"parallelism": {"tp": 2}},
    # device: cuda and no GPU asked of Ray: the replica would find none.
    {"resources": {"gpus": 0}},
], ids=["fractional-gpus-over-2-ranks", "cuda-without-gpus"])
def test_impossible_gpu_requests_are_refused(tmp_path, decode):
    with pytest.raises(ManifestInvalid) as info:
        validate_file(_mutated_gpu_1(tmp_path, **decode), check_ports=False)
    errors = info.value.errors
    assert errors and all(e.path.startswith("pools.decode") for e in errors), errors
    assert any("gpu" in f"{e.path} {e.message}".lower() for e in errors), errors
