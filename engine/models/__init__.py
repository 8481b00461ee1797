"""Model implementations. Every supported architecture maps to a class that `build_model` instantiates."""

from tandem.engine.models.llama import LlamaModel, build_model

__all__ = ["LlamaModel", "build_model"]
