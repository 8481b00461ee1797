"""load_model_info: a model's config and tokenizer read without torch (what the router loads), the same ones
load_model(weights=False) gives the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.engine.errors import ModelLoadError
from tandem.engine.loader import load_model
from tandem.engine.loader.model_info import load_model_info
from tandem.engine.loader.synthetic import write_synthetic_model

SAMPLE = "Hello, wörld! 12345 <|im_end|>"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]

# Runs in a fresh interpreter: this test process imported torch long ago.
PROBE = """
import json, sys

from tandem.engine.loader.model_info import load_model_info

info = load_model_info(None if sys.argv[1] == "embedded" else sys.argv[1])
chat = json.loads(sys.argv[3])
print(json.dumps({
    "config": repr(info.config), "source": str(info.source), "vocab_size": info.config.vocab_size,
    "num_layers": info.config.num_layers, "eos_token_ids": list(info.tokenizer.eos_token_ids),
    "ids": info.tokenizer.encode(sys.argv[2]), "chat_ids": info.tokenizer.encode_chat(chat),
    "torch_modules": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
}))
"""


def _probe(model: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, model, SAMPLE, json.dumps(CHAT)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _assert_same_model(info: dict, path) -> None:
    loaded = load_model(path, weights=False, progress=False)
    assert info["config"] == repr(loaded.config)
    assert info["source"] == str(loaded.source)
    assert (info["vocab_size"], info["num_layers"]) == (loaded.config.vocab_size, loaded.config.num_layers)
    assert info["eos_token_ids"] == list(loaded.tokenizer.eos_token_ids) != []
    assert info["ids"] == loaded.tokenizer.encode(SAMPLE)
    assert info["chat_ids"] == loaded.tokenizer.encode_chat(CHAT)


def test_embedded_gguf_without_torch():
    info = _probe("embedded")
    assert info["torch_modules"] == []
    assert (info["vocab_size"], info["num_layers"]) == (49152, 30)
    _assert_same_model(info, None)


def test_hugging_face_folder_without_torch(tmp_path):
    folder = write_synthetic_model("tiny-moe", tmp_path / "tiny-moe")
    info = _probe(str(folder))
    assert info["torch_modules"] == []
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == info["num_layers"]
    _assert_same_model(info, folder)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_info(tmp_path / "nope.gguf")
