"""engine/'s import graph, read from the source with `ast`: every import statement, including those inside
functions and under `if TYPE_CHECKING:`, unless a rule below says otherwise.

(a) engine/ is the bottom of tandem: it imports no other tandem package (kv_transfer, router, cluster,
    prefill_worker, decode_worker, replica, proto are built on it, never the reverse).
(b) No import cycle between modules at module level. Imports inside functions and under TYPE_CHECKING run
    later and are left out, and so is a module's import of its own enclosing packages (Python has started
    those before the module); importing a.b.c counts as importing the packages a.b too.
(c) Subfolders are layers (FOLDER_LAYERS): a subfolder imports only subfolders of lower layers, counting every
    import. Top-level modules (errors.py, model_config.py, request.py, ...) sit between them wherever their
    imports put them: in the graph whose nodes are the subfolders (one node each) and the top-level modules
    (one node each), there is no cycle. engine/parallel/ imports nothing else from engine/ (models,
    kv_transfer and cluster share it), and engine/runner/ranks/ is imported only by engine/runner/builder.py.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
PACKAGE = "tandem.engine"

# Subfolders by layer, lowest first: a subfolder may import the subfolders of lower layers only.
FOLDER_LAYERS = (
    ("parallel", "tokenizer", "hardware", "kv"),  # the split and its collectives; text <-> ids; CPU/GPU probes
    # and kernel timing; the KV store, its blocks and the prefix cache
    ("attention",),  # attention kernels over the paged KV cache
    ("models",),  # the decoder's torch modules, sharded as parallel/ says
    ("loader",),  # files -> config, tokenizer and weights -> a model
    ("decoding",),  # sampling, speculation and its proposers, structured output's grammars
    ("runner",),  # the executors and the model runner; the processes of a replica that spans several (ranks/)
    ("core",),  # the engine, its scheduler and KV cache manager, its output processing
)


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module and package of engine/."""
    found = {}
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imported_names(module: str, path: Path, *, module_level_only: bool) -> list[tuple[str, int]]:
    """Every (dotted name, line) an import statement of the file names: `import a.b` gives a.b; `from a import b`
    gives a.b and a (b may be a submodule or a name defined in a)."""
    names: list[tuple[str, int]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if module_level_only and isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                names.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names.append((base, child.lineno))
                names.extend((f"{base}.{alias.name}", child.lineno) for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def _engine_targets(module: str, name: str) -> set[str]:
    """The engine modules importing `name` runs: the longest engine module it names, and that module's enclosing
    packages, except those enclosing `module` itself (already being imported when its body runs)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    targets = set()
    for end in range(len(PACKAGE.split(".")) + 1, len(parts) + 1):
        target = ".".join(parts[:end])
        if target != module and not module.startswith(target + "."):
            targets.add(target)
    return targets


def _graph(*, module_level_only: bool) -> dict[str, dict[str, int]]:
    """module -> {engine module it imports: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges: dict[str, int] = {}
        for name, line in _imported_names(module, path, module_level_only=module_level_only):
            for target in _engine_targets(module, name):
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def _node(module: str) -> str:
    """A subfolder's name for its modules, else the top-level module's own name."""
    parts = _short(module).split(".")
    return parts[0] if module != PACKAGE else "__init__"


def _folder_edges() -> dict[tuple[str, str], list[str]]:
    """(node, node) -> the imports that make that edge, as 'module:line -> module'."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, targets in _graph(module_level_only=False).items():
        for target, line in targets.items():
            if _node(module) != _node(target):
                edges[_node(module), _node(target)].append(f"{_short(module)}:{line} -> {_short(target)}")
    return edges


def test_the_graph_sees_the_engine():
    """Guards the other tests against passing vacuously: the parser finds imports it must find."""
    graph = _graph(module_level_only=False)
    assert "tandem.engine.runner.ranks.executor" in graph["tandem.engine.runner.builder"]  # imported inside a function
    assert "tandem.engine.scheduler_output" in graph["tandem.engine.core.scheduler"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_engine_imports_no_layer_above_it():
    offenders: dict[str, str] = {}  # file:line -> the module it names (the shortest, for `from a import b`)
    for module, path in MODULES.items():
        for name, line in _imported_names(module, path, module_level_only=False):
            if name.split(".")[0] == "tandem" and not (name == PACKAGE or name.startswith(PACKAGE + ".")):
                where = f"{path.relative_to(ENGINE.parent)}:{line}"
                offenders[where] = min(offenders.get(where, name), name, key=len)
    assert not offenders, "engine/ must not import the packages built on it:\n" + "\n".join(
        f"{where} imports {name}" for where, name in sorted(offenders.items()))


def test_no_module_level_import_cycle():
    graph = _graph(module_level_only=True)
    cycle = _find_cycle({module: set(targets) for module, targets in graph.items()})
    assert cycle is None, "module-level import cycle (module:line of the import): " + " -> ".join(
        f"{_short(a)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + f" -> {_short(cycle[-1])}"


def test_folders_are_layers():
    subfolders = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").is_file()}
    layer_of = {folder: i for i, layer in enumerate(FOLDER_LAYERS) for folder in layer}
    assert subfolders == set(layer_of), "every subfolder of engine/ has a place in FOLDER_LAYERS"
    edges = _folder_edges()
    wrong = [f"{a} -> {b} ({', '.join(why)})" for (a, b), why in sorted(edges.items())
             if a in layer_of and b in layer_of and layer_of[b] >= layer_of[a]]
    assert not wrong, "a subfolder imports one of its own layer or above:\n" + "\n".join(wrong)


def test_folder_graph_has_no_cycle():
    edges = _folder_edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    cycle = _find_cycle(graph)
    assert cycle is None, "folder-level import cycle: " + "; ".join(
        f"{a} -> {b} ({', '.join(edges[a, b])})" for a, b in zip(cycle, cycle[1:]))


def test_parallel_imports_nothing_else_from_the_engine():
    imports = [f"{a} -> {b}: {', '.join(why)}" for (a, b), why in sorted(_folder_edges().items()) if a == "parallel"]
    assert not imports, "\n".join(imports)


def test_only_the_builder_starts_ranks():
    ranks = PACKAGE + ".runner.ranks"
    importers = sorted(_short(a) for a, targets in _graph(module_level_only=False).items()
                       if not a.startswith(ranks) and any(b.startswith(ranks) for b in targets))
    assert importers == ["runner.builder"]
