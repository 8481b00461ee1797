"""Hugging Face folders, without their weights: `config.json` (stop ids from `generation_config.json` when it
has them) -> ModelConfig, and `tokenizer.json` with its config -> Tokenizer. Torch-free; hf_folder.py reads the
safetensors."""

from __future__ import annotations

from pathlib import Path

from tandem.engine.errors import ModelLoadError
from tandem.engine.loader.checkpoint import ModelInfo
from tandem.engine.model_config import model_config_from_hf, read_json_file
from tandem.engine.tokenizer import Tokenizer


def hf_model_info(folder: Path) -> ModelInfo:
    """The config and tokenizer of a Hugging Face model folder. Raises ModelLoadError when config.json or the
    tokenizer is missing or malformed, UnsupportedModelError for an architecture tandem does not run."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: config.json is missing; is this a Hugging Face model folder?")
    raw = read_json_file(config_path)
    generation = folder / "generation_config.json"
    if generation.is_file() and "eos_token_id" in (gen := read_json_file(generation)):
        raw = raw | {"eos_token_id": gen["eos_token_id"]}
    config = model_config_from_hf(raw)
    tokenizer = Tokenizer.from_folder(folder, eos_token_ids=config.eos_token_ids)
    return ModelInfo(config=config, tokenizer=tokenizer, source=folder)
