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


def test_engine_policy_code_never_imports_torch():
    """STYLE.md: block pool, prefix cache, scheduler and request state are plain Python."""
    import subprocess
    import sys

    policy = ["block_pool", "prefix_cache", "kv_cache_manager", "kv_events", "request", "scheduler",
              "scheduler_output", "sampling_params", "stop_strings", "engine_config"]
    code = ("import sys\n" + "".join(f"import tandem.engine.{m}\n" for m in policy)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
