"""The command line a user runs, as separate processes: `tandem up --detach` starts a local Ray head and the
cluster and returns once it serves; `tandem status` (text and --json) and `tandem generate --target` reach it
from other processes; `tandem down` stops it and the Ray head it started, freeing the port."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.ray_cluster import MANIFESTS

TANDEM = [sys.executable, "-m", "tandem.cluster.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=timeout)


def ray_is_running() -> bool:
    import ray

    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError:
        return False
    ray.shutdown()
    return True


@pytest.fixture
def manifest(tmp_path: Path) -> tuple[Path, int]:
    if ray_is_running():
        pytest.fail("a Ray cluster is already running on this machine; this test starts and stops its own")
    port = free_port()
    text = (MANIFESTS / "local.yaml").read_text().replace("name: tandem", "name: cli-test")
    path = tmp_path / "cli.yaml"
    path.write_text(text.replace("127.0.0.1:50051", f"127.0.0.1:{port}")
                    .replace("127.0.0.1:8000", f"127.0.0.1:{free_port()}"))
    return path, port


def test_up_detach_status_generate_down(manifest):
    manifest, port = manifest
    up = tandem("up", str(manifest), "--detach", "--ask", "Say hi.", "--max-tokens", "6")
    try:
        assert up.returncode == 0, up.stderr
        assert "> Say hi." in up.stdout and "TTFT" in up.stderr and "6 tokens" in up.stderr  # the sample request
        endpoint = f"127.0.0.1:{port}"
        assert "starting a local Ray head" in up.stderr
        assert f"gRPC      {endpoint}" in up.stderr
        assert "prefill-0 ready" in up.stderr and "decode-0 ready" in up.stderr

        status = tandem("status", "--name", "cli-test")
        assert status.returncode == 0, status.stderr
        assert "prefill-0" in status.stdout and "decode-0" in status.stdout and "ready" in status.stdout
        report = json.loads(tandem("status", "--name", "cli-test", "--json").stdout)
        assert {r["name"]: r["pool"] for r in report["replicas"]} == {"prefill-0": "prefill", "decode-0": "decode"}
        assert all(r["kv_blocks_total"] > 0 and r["kv_blocks_in_use"] == 0 for r in report["replicas"])

        remote = tandem("generate", "--target", endpoint, "--prompt", "The capital of France is", "--max-tokens", "6",
                        "--json")
        local = tandem("generate", "--prompt", "The capital of France is", "--max-tokens", "6", "--json")
        assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
        assert json.loads(remote.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]

        again = tandem("up", str(manifest), "--detach")
        assert again.returncode != 0 and "already" in again.stderr
    finally:
        down = tandem("down", "--name", "cli-test")
    assert down.returncode == 0, down.stderr
    assert "stopped" in down.stderr
    assert not ray_is_running()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the router's port is free again


def test_status_without_a_cluster_says_so():
    done = tandem("status", timeout=60)
    assert done.returncode == 1
    assert "no Ray cluster" in done.stderr or "no tandem cluster" in done.stderr
