"""The repository keeps DESIGN.md's layout, and every Python package in it is installed."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN_FOLDERS = ["cluster", "prefill_worker", "decode_worker", "router", "kv_transfer", "proto", "deploy",
                  "engine", "bench", "tests", "docs"]


def test_design_folders_exist():
    missing = [f for f in DESIGN_FOLDERS if not (ROOT / f).is_dir()]
    assert not missing


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == listed, f"unlisted: {sorted(found - listed)}, listed but absent: {sorted(listed - found)}"


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
