"""The Ray head tandem starts runs with Ray's token authentication (cluster/local_ray.py): a fresh token, readable
by its user only; tandem's own processes (the driver that started it, a later `tandem status` / `down`) use it
whatever the shell's RAY_AUTH_* or a stale ~/.ray/auth_token say; a client without it is refused, and told why
at once (RayAuthRefused names where its token came from and the fix) instead of Ray retrying for 20 s."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.cluster import local_ray

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import ray
from tandem.cluster import launcher, local_ray
started = launcher.connect(None, "tandem", start_if_missing={start})
@ray.remote
def answer():
    return 42
print("started" if started else "found", ray.get(answer.remote(), timeout=120), local_ray.recorded().token_path)
"""

PROBE = """
from tandem.cluster import local_ray
try:
    print("answers", local_ray.answers(local_ray.recorded().gcs_address))
except local_ray.RayAuthRefused as e:
    print("refused:", e)
"""

RAW_CALL = """
import grpc
from ray._private.grpc_utils import init_grpc_channel
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
from tandem.cluster import local_ray
channel = init_grpc_channel(local_ray.recorded().gcs_address)
try:
    gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=10)
    print("served")
except grpc.RpcError as e:
    print(e.code().name)
"""


def python(code: str, env: dict, timeout: float = 240) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture
def home(tmp_path):
    """A home whose ~/.ray/auth_token is another cluster's (stale), and a shell that turned Ray's auth off."""
    deadline = time.monotonic() + 15
    while local_ray.ray_processes_running():
        if time.monotonic() > deadline:
            pytest.fail("a Ray cluster is already running on this machine; this test starts and stops its own")
        time.sleep(0.5)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("another clusters token, long gone")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    yield tmp_path, env | {"HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    if (head := local_ray.recorded()) is not None:
        local_ray.stop(head, grace_s=2.0)


def test_the_local_head_takes_only_clients_with_its_token(home):
    tmp_path, env = home
    started = python(DRIVER.format(start={"CPU": 1}), env).split()
    assert started[:2] == ["started", "42"]  # tandem's driver and the workers it started: served
    token = Path(started[2])
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    again = python(DRIVER.format(start=None), env).split()  # a later `tandem status` / `down`
    assert again[:2] == ["found", "42"]

    # Any other client: the stale token, none at all, or a wrong one in the environment.
    for extra in ({}, {"RAY_AUTH_MODE": "token"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "guess"}):
        assert python(RAW_CALL, env | extra) == "UNAUTHENTICATED", extra
    refused = python(PROBE, {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"})
    assert refused.startswith("refused: the Ray head at ") and f"{tmp_path}/.ray/auth_token" in refused
    assert f"RAY_AUTH_TOKEN_PATH={token}" in refused  # the fix
    with_token = env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    assert python(RAW_CALL, with_token) == "served"
