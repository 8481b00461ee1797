"""A manifest file read into the schema (cluster/manifest.py): load_manifest / parse_manifest read the YAML and
validate it, and every validation error becomes a ManifestError that carries its YAML path, the line of the file
it sits on (line_map) and a hint (the keys allowed where an unknown one was found). ManifestInvalid lists them
all. read_yaml, line_map and manifest_from are the steps, for checks that need the parsed YAML as well
(cluster/manifest_checks.py).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import ValidationError

from tandem.cluster.manifest import Manifest


@dataclass(frozen=True)
class ManifestError:
    path: str  # dotted YAML path, e.g. "pools.prefill.parallelism.tp"
    message: str
    hint: str | None = None
    line: int | None = None  # 1-based line in the file, where known

    def format(self, source: str) -> str:
        where = f"{source}:{self.line}" if self.line else source
        text = f"{where}: {self.path or '(top level)'}: {self.message}"
        return text + (f"\n    hint: {self.hint}" if self.hint else "")


class ManifestInvalid(ValueError):
    def __init__(self, source: str, errors: list[ManifestError]):
        self.source = source
        self.errors = errors
        lines = [e.format(source) for e in errors]
        super().__init__(f"{source}: {len(errors)} error(s) in the manifest\n" + "\n".join(lines))


def line_map(text: str) -> dict[tuple, int]:
    """Every YAML path (tuple of keys / indices) to the 1-based line its key or item starts on."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = path + (key.value,)
                lines[child] = key.start_mark.line + 1
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[path + (i,)] = item.start_mark.line + 1
                walk(item, path + (i,))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _model_fields(loc: tuple) -> list[str]:
    """Field names allowed at the mapping that holds loc[-1], for 'did you mean' hints."""
    model: Any = Manifest
    keyed = False  # the key before was a mapping of names to models (auth.tenants): this key is a name
    for key in loc[:-1]:
        if keyed:
            keyed = False
            continue
        field = getattr(model, "model_fields", {}).get(key)
        if field is None:
            return []
        annotation = field.annotation
        keyed = get_origin(annotation) is dict
        args = getattr(annotation, "__args__", (annotation,))[1 if keyed else 0:]
        candidates = [a for a in args if hasattr(a, "model_fields")]
        if not candidates:
            return []
        model = candidates[0]
    return list(getattr(model, "model_fields", {}))


def _pydantic_errors(error: ValidationError, lines: dict[tuple, int]) -> list[ManifestError]:
    found = []
    for e in error.errors():
        loc = tuple(p for p in e["loc"] if p not in ("function-after",))
        path = ".".join(str(p) for p in loc)
        hint = None
        if e["type"] == "extra_forbidden":
            allowed = _model_fields(loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = (f"did you mean {close[0]!r}? " if close else "") + f"allowed here: {', '.join(allowed)}"
            message = f"unknown key {loc[-1]!r}"
        elif e["type"] == "missing":
            message = "is required"
        else:
            message = str(e["msg"]).removeprefix("Value error, ")
            if e["type"] == "literal_error":
                hint = f"got {e.get('input')!r}"
        line = next((lines[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in lines), None)
        found.append(ManifestError(path, message, hint, line))
    return found


def read_yaml(text: str, source: str = "<manifest>") -> dict:
    """The manifest text as a mapping. Raises ManifestInvalid for invalid YAML or anything but a mapping."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ManifestInvalid(source, [ManifestError("", f"not valid YAML: {getattr(e, 'problem', e)}",
                                                     line=mark.line + 1 if mark else None)]) from None
    if not isinstance(data, dict):
        raise ManifestInvalid(source, [ManifestError("", "the manifest must be a YAML mapping",
                                                     "start from deploy/manifests/local.yaml")])
    return data


def manifest_from(data: dict, lines: dict[tuple, int], source: str = "<manifest>") -> Manifest:
    """Structurally validates parsed YAML (lines: line_map of its text). Raises ManifestInvalid listing every
    error found."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        raise ManifestInvalid(source, _pydantic_errors(e, lines)) from None


def parse_manifest(text: str, source: str = "<manifest>") -> Manifest:
    """Parses and structurally validates a manifest. Raises ManifestInvalid listing every error found."""
    return manifest_from(read_yaml(text, source), line_map(text), source)


def read_text(path: Path) -> str:
    """The manifest file's text. Raises ManifestInvalid naming the file if it cannot be read."""
    try:
        return path.read_text()
    except OSError as e:
        raise ManifestInvalid(str(path), [ManifestError("", f"cannot be read: {e.strerror}")]) from None


def load_manifest(path: str | Path) -> Manifest:
    """Reads a manifest file. Raises ManifestInvalid (which is a ValueError) naming the file."""
    path = Path(path)
    return parse_manifest(read_text(path), str(path))
