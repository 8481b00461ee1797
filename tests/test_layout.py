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
              "scheduler_output", "sampled_token", "sampling_params", "stop_strings", "engine_config"]
    code = ("import sys\n" + "".join(f"import tandem.engine.{m}\n" for m in policy)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# DESIGN.md section 1, with replica/ (the shell, spec and router/replica contract the two worker roles share)
# between the workers and kv_transfer: each folder may import only these tandem folders besides itself.
LAYERS = {
    "proto": set(),
    "engine": set(),
    "kv_transfer": {"engine"},
    "replica": {"kv_transfer", "engine", "proto"},
    "prefill_worker": {"replica", "kv_transfer", "engine", "proto"},
    "decode_worker": {"replica", "kv_transfer", "engine", "proto"},
    "router": {"replica", "kv_transfer", "engine", "proto"},
    "cluster": {"router", "prefill_worker", "decode_worker", "replica", "kv_transfer", "engine", "proto", "bench"},
}
# bench/ may import anything, but its load generator (which `tandem bench` offers through cluster/cli.py) is a
# client of the API: the router's client and types, the proto and the engine's torch-free tokenizer only.
LOADGEN_MAY_IMPORT = ("tandem.bench.loadgen", "tandem.router.client", "tandem.proto.", "tandem.engine.loader.model_info")
# What the router takes from the layers below it: types and the torch-free loader, never a runtime module.
ROUTER_MAY_IMPORT = ("tandem.replica.contract", "tandem.replica.remote", "tandem.kv_transfer.descriptor",
                     "tandem.kv_transfer.drops",  # MessageDrops: a plain value in ReplicaStats
                     "tandem.engine.", "tandem.proto.")


def _tandem_imports(folder: str) -> list[tuple[str, str]]:
    """(file, imported tandem module) for every import in folder, including those inside functions."""
    import ast

    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [(str(path.relative_to(ROOT)), n) for n in names if n.startswith("tandem.")]
    return found


def test_folders_import_only_the_layers_below_them():
    wrong = [(f, m) for folder, allowed in LAYERS.items() for f, m in _tandem_imports(folder)
             if m.split(".")[1] not in allowed | {folder}]
    assert not wrong, f"imports against DESIGN.md's layers: {wrong}"


def test_the_cluster_takes_only_the_load_generator_from_bench_and_it_is_only_a_client():
    from_bench = [(f, m) for f, m in _tandem_imports("cluster") if m.startswith("tandem.bench.")]
    assert from_bench and all(m.startswith("tandem.bench.loadgen.") for _, m in from_bench)
    wrong = [(f, m) for f, m in _tandem_imports("bench/loadgen") if not m.startswith(LOADGEN_MAY_IMPORT)]
    assert not wrong, f"the load generator imports more than a client needs: {wrong}"


def test_the_router_imports_contracts_and_types_only():
    engine_runtime = ("tandem.engine.llm_engine", "tandem.engine.async_engine", "tandem.engine.model_runner",
                      "tandem.engine.models", "tandem.engine.ranks", "tandem.engine.loader.model_loader")
    wrong = [(f, m) for f, m in _tandem_imports("router") if m.split(".")[1] != "router"
             and (not m.startswith(ROUTER_MAY_IMPORT) or m.startswith(engine_runtime))]
    assert not wrong, f"the router imports runtime modules: {wrong}"
