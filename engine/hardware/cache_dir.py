"""Where tandem keeps what it measures, compiles or parses once per machine or file: $TANDEM_CACHE_DIR, else
$XDG_CACHE_HOME/tandem, else ~/.cache/tandem. Plain Python (the router's GGUF index reads it too)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "TANDEM_CACHE_DIR"


def cache_root() -> Path:
    """The folder (not created here); read on every call, so a test or a process may move it."""
    return Path(os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tandem"))
