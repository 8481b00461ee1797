"""Loads a model from a Hugging Face folder or a GGUF file (default: the embedded SmolLM2-135M-Instruct GGUF)."""

from tandem.engine.loader.checkpoint import Checkpoint, default_model_path, load_checkpoint
from tandem.engine.loader.model_loader import LoadedModel, load_model

__all__ = ["Checkpoint", "LoadedModel", "default_model_path", "load_checkpoint", "load_model"]
