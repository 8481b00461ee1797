"""Bad model inputs end in one clear ModelLoadError (and, through the CLI, exit code 2 with no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter

from tandem.engine.errors import ModelLoadError, UnsupportedModelError
from tandem.engine.loader import default_model_path, load_checkpoint
from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return default_model_path().read_bytes()


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [64, 100_000, 2_000_000])
def test_truncated_gguf(tmp_path, gguf_bytes, keep):
    """Cut inside the header, inside the metadata (vocabulary) and inside the tensor data."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_bytes[:keep])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_checkpoint(path)


def test_corrupt_gguf_header(tmp_path, gguf_bytes):
    rng = np.random.default_rng(0)
    path = tmp_path / "garbled.gguf"
    path.write_bytes(gguf_bytes[:4] + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'falcon' is not supported"):
        load_checkpoint(path)


@pytest.fixture()
def tiny_folder(tmp_path, embedded):
    return write_tiny_model(tmp_path / "tiny", "llama3", embedded.tokenizer)


def _edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_unsupported_hf_architecture(tiny_folder):
    _edit_config(tiny_folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        load_checkpoint(tiny_folder)


def test_config_weights_shape_mismatch(tiny_folder):
    from tandem.engine.loader import load_model

    _edit_config(tiny_folder, intermediate_size=192)
    with pytest.raises(ModelLoadError, match=r"mlp.gate_proj.weight' has shape \(160, 64\) but the config implies "
                                             r"\(192, 64\)"):
        load_model(tiny_folder, progress=False)


def test_missing_tokenizer(tiny_folder):
    (tiny_folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json is missing"):
        load_checkpoint(tiny_folder)


def test_missing_shard(tiny_folder):
    shard = sorted(tiny_folder.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"shard '{shard.name}'.*is missing"):
        load_checkpoint(tiny_folder)


def test_cli_reports_a_bad_model_without_traceback(tmp_path, gguf_bytes):
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_bytes[:2_000_000])
    proc = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "generate", "--model", str(path),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "truncated" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
