"""The cpu image, run: `tandem generate` inside it, and its `tandem up` serving deploy/manifests/local-colocated.yaml
to the `openai` client from outside the container.

Needs the image (`make image VARIANT=cpu`, about ten minutes and 10 GB of buildah's vfs storage) and buildah, so it
is marked slow and skipped where either is missing. buildah runs the container with chroot isolation, sharing the
host's network: what a container runtime would add (its own network namespace, published ports, cgroup limits) is
in deploy/docker/README.md."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"localhost/tandem:{VERSION}-cpu"
BUILDAH = ["buildah", "--storage-driver", "vfs"]


def image_present() -> bool:
    if shutil.which("buildah") is None or os.geteuid() != 0:
        return False
    return subprocess.run([*BUILDAH, "inspect", "--type", "image", IMAGE], capture_output=True).returncode == 0


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not image_present(), reason=f"needs buildah (as root) and {IMAGE}: make image")]


@pytest.fixture
def container():
    name = subprocess.run([*BUILDAH, "from", IMAGE], capture_output=True, text=True, check=True).stdout.strip()
    yield name
    subprocess.run([*BUILDAH, "rm", name], capture_output=True)


def in_container(container: str, *command: str, mounts: tuple[str, ...] = ()) -> list[str]:
    volumes = [flag for mount in mounts for flag in ("-v", mount)]
    return [*BUILDAH, "run", "--isolation", "chroot", *volumes, container, "--", *command]


def test_the_cpu_image_generates_and_serves_the_openai_client(container, tmp_path):
    generated = subprocess.run(in_container(container, "tandem", "generate", "--chat", "Say hello.",
                                            "--max-tokens", "16", "--temperature", "0"),
                               capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert len(generated.stdout.strip()) > 3, generated.stdout

    # local-colocated.yaml as shipped in the image, on free loopback ports (the container shares this network).
    grpc_port, http_port = free_port(), free_port()
    manifest = (ROOT / "deploy" / "manifests" / "local-colocated.yaml").read_text()
    manifest = re.sub(r"(?m)^  grpc: 127\.0\.0\.1:\d+$", f"  grpc: 127.0.0.1:{grpc_port}", manifest)
    manifest = re.sub(r"(?m)^  http: 127\.0\.0\.1:\d+$", f"  http: 127.0.0.1:{http_port}", manifest)
    (tmp_path / "manifest.yaml").write_text(manifest)
    tmp_path.chmod(0o755)
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(in_container(container, "tandem", "up", "/mnt/manifest.yaml",
                                       mounts=(f"{tmp_path}:/mnt:ro",)),
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import openai

        assert processes_inside(), "tandem up is not running inside the container's root"

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", timeout=30)
        deadline = time.monotonic() + 420
        while True:
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()[-3000:]
                time.sleep(2)
        assert [model.id for model in models.data] == ["SmolLM2-135M-Instruct"]
        answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=16, temperature=0,
                                                messages=[{"role": "user", "content": "What is 2+2?"}])
        assert answer.choices[0].message.content.strip()
        assert answer.usage.completion_tokens > 0
    finally:
        # SIGTERM to tandem up itself, which takes its cluster and its Ray head down; buildah run then returns.
        # (Not to buildah run or its chroot helper, whose end would cut tandem up off before it stops the head: with
        # chroot isolation there is no PID namespace whose end would take the rest along.)
        running = processes_inside()
        for pid, what in running.items():
            if what.startswith("tandem: ") and " up /mnt/manifest.yaml" in what:
                os.kill(pid, signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in running) and time.monotonic() < deadline:
        time.sleep(1)
    left = [what for pid, what in running.items() if alive(pid)]
    assert not left, f"processes left after tandem up stopped: {left}"
    assert any(what.startswith("raylet: ") for what in running.values()), "the Ray head ran inside the container"


def processes_inside() -> dict[int, str]:
    """The processes chrooted into a `buildah run` (buildah's chroot isolation binds the container's file system at
    /var/tmp/buildahN/mnt/rootfs for each run; the test runs one at a time), by pid: their comm and command line."""
    inside = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and re.fullmatch(r"/var/tmp/buildah\d+/mnt/rootfs", os.readlink(proc / "root")):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                inside[int(proc.name)] = f"{(proc / 'comm').read_text().strip()}: {command[:120]}"
        except OSError:
            continue
    return inside


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
