"""The command line a user runs, as separate processes, on one manifest (one tp=1 colocated replica of the small
generated model, which loads in a blink) and the same ports throughout: every `tandem up` follows the stop before
it at once, while the HTTP connections of the last run sit in TIME_WAIT on the router's port, and starts a fresh
local Ray head that listens on loopback only.

1. Over a stale Ray address file (a head that died without clean-up): `tandem up --detach --ask` notices the dead
   head and starts a fresh one; `tandem status` (text and --json) and `tandem generate --target` reach the
   cluster from other processes; HTTP traffic; `tandem down --drain` while a client sends requests back to back:
   the running one finishes whole, later ones are refused (503, Retry-After) or find the router gone.
2. A foreground `tandem up`, HTTP traffic, then its GCS freezes (SIGSTOP: it answers nothing and ignores
   SIGTERM), then SIGTERM (`timeout`, service managers): it stops as on Ctrl-C, Ray head included, in seconds.
3. A foreground `tandem up` gets SIGHUP (a closed terminal) while it starts: it stops what it started.
4. `tandem up --detach`, HTTP traffic, a frozen GCS again: `tandem down` still ends every process of the Ray
   head tandem started.

After each stop no process of that Ray head is left, Ray's address file no longer names it, and the ports are free.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tandem.cluster import local_ray
from tandem.cluster.manifest_checks import is_loopback, listen_problem
from tandem.engine.core.generator import Generator
from tandem.engine.loader import load_model
from tandem.engine.loader.synthetic import write_synthetic_model
from tandem.engine.sampling_params import SamplingParams
from tests.ports import free_port

TANDEM = [sys.executable, "-m", "tandem.cluster.cli"]
MANIFEST = """\
name: cli-test
model: {model}
mode: colocated
pools:
  decode:
    resources: {{cpus: 1.0}}
    engine: {{kv_cache_bytes: 8MiB, max_num_seqs: 8, max_model_len: 512}}
listen:
  grpc: 127.0.0.1:{grpc}
  http: 127.0.0.1:{http}
"""


def tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_synthetic_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")


@pytest.fixture
def cluster(tmp_path: Path, tiny_model: Path):
    """(manifest path, gRPC port, HTTP port); whatever Ray head the test leaves behind is stopped."""
    deadline = time.monotonic() + 15  # a cluster an earlier test stopped may take a moment to exit
    while local_ray.ray_processes_running():
        if time.monotonic() > deadline:
            pytest.fail("a Ray cluster is already running on this machine; this test starts and stops its own")
        time.sleep(0.5)
    grpc, http = free_port(), free_port()
    path = tmp_path / "cli.yaml"
    path.write_text(MANIFEST.format(model=tiny_model, grpc=grpc, http=http))
    yield path, grpc, http
    if (head := local_ray.recorded()) is not None:
        local_ray.stop(head, grace_s=2.0)


@contextlib.contextmanager
def foreground_up(manifest: Path, log: Path, until: str = "is serving"):
    """Yields (a foreground `tandem up` process, the Ray head it started) once the process wrote until to log.
    A process the test did not stop is stopped on the way out."""
    with log.open("w") as err:
        up = subprocess.Popen([*TANDEM, "up", str(manifest)], stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while until not in log.read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert "starting a local Ray head on 127.0.0.1" in log.read_text()
        yield up, local_ray.recorded()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=120)


def http_traffic(port: int) -> None:
    """A few OpenAI completions; the server closes each connection, leaving it in TIME_WAIT on its port."""
    for prompt in ("Hi", "The sky is", "One, two,"):
        body = json.dumps({"model": "tiny-moe", "prompt": prompt, "max_tokens": 2}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200 and json.loads(reply.read())["choices"][0]["finish_reason"]


LONG_TOKENS = 300


@contextlib.contextmanager
def back_to_back_requests(port: int):
    """A client sending completions of LONG_TOKENS tokens one after another until the block ends or the router
    stops taking them; yields the list it fills: each reply's JSON, or the urllib error that ended a request."""
    replies: list = []
    stop = threading.Event()

    def client() -> None:
        body = json.dumps({"model": "tiny-moe", "prompt": "Count:", "max_tokens": LONG_TOKENS,
                           "ignore_eos": True}).encode()
        while not stop.is_set():
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    replies.append(json.loads(reply.read()))
            except urllib.error.URLError as e:
                replies.append(e)
                if not isinstance(e, urllib.error.HTTPError):
                    return  # the router stopped
                time.sleep(0.1)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    time.sleep(1.0)
    try:
        yield replies
    finally:
        stop.set()
        thread.join(130)


def _tcp_sockets() -> list[tuple[str, int, str, str]]:
    """(local host, local port, state in hex, inode) of every TCP socket on this machine."""
    sockets = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word little-endian
            ip = ipaddress.ip_address(raw)
            sockets.append((str(getattr(ip, "ipv4_mapped", None) or ip), int(port, 16), fields[3], fields[9]))
    return sockets


def listening_hosts(pids: list[int]) -> set[str]:
    """The hosts the processes pids listen on (TCP)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    return {host for host, _, state, inode in _tcp_sockets() if state == "0A" and inode in inodes}


def in_time_wait(port: int) -> bool:
    return any(p == port and state == "06" for _, p, state, _ in _tcp_sockets())


def freeze_gcs(head: local_ray.LocalHead) -> None:
    """SIGSTOP for the head's GCS: it accepts connections and answers nothing, as a hung one does."""
    [gcs] = [pid for pid in local_ray.processes(head) if Path(f"/proc/{pid}/comm").read_text().strip() == "gcs_server"]
    os.kill(gcs, signal.SIGSTOP)


def assert_stopped(head: local_ray.LocalHead, *ports: int) -> None:
    deadline = time.monotonic() + 10  # killed processes vanish once reaped
    while local_ray.processes(head) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert local_ray.processes(head) == [], "processes of the Ray head tandem started survived"
    assert local_ray.recorded() is None and local_ray.current_address() != head.gcs_address
    assert [listen_problem(f"127.0.0.1:{port}") for port in ports] == [None] * len(ports)


def test_up_traffic_and_stop_four_times_in_a_row(cluster, tmp_path, tiny_model):
    manifest, grpc, http = cluster
    endpoint = f"127.0.0.1:{grpc}"

    # 1. A stale address file, then up --detach, status, generate, refused twin, traffic, down.
    local_ray.address_file().parent.mkdir(parents=True, exist_ok=True)
    local_ray.address_file().write_text(f"127.0.0.1:{free_port()}")
    up = tandem("up", str(manifest), "--detach", "--ask", "Say hi.", "--max-tokens", "6")
    assert up.returncode == 0, up.stderr
    assert "does not answer within 5 s and no Ray process runs here: forgetting that stale address" in up.stderr
    assert "starting a local Ray head on 127.0.0.1" in up.stderr and "decode-0 ready" in up.stderr
    assert f"gRPC      {endpoint}" in up.stderr
    assert "> Say hi." in up.stdout and "6 tokens" in up.stderr  # the sample request
    head = local_ray.recorded()
    assert local_ray.current_address() == head.gcs_address
    assert all(is_loopback(host) for host in listening_hosts(local_ray.processes(head)))  # Ray's ports, the router's

    status = tandem("status", "--name", "cli-test")
    assert status.returncode == 0, status.stderr
    assert "decode-0" in status.stdout and "ready" in status.stdout
    assert re.search(r"router: serving, .* standby (starting|ready)", status.stdout), status.stdout
    report = json.loads(tandem("status", "--name", "cli-test", "--json").stdout)
    assert [(r["name"], r["kv_blocks_in_use"]) for r in report["replicas"]] == [("decode-0", 0)]
    remote = tandem("generate", "--target", endpoint, "--prompt", "The capital of France is", "--max-tokens", "6",
                    "--json")
    assert remote.returncode == 0, remote.stderr
    loaded = load_model(str(tiny_model), progress=False)
    with Generator(loaded, max_model_len=512) as here:
        local = here.generate(loaded.tokenizer.encode("The capital of France is"),
                              SamplingParams(max_tokens=6, temperature=0))
    assert json.loads(remote.stdout)["token_ids"] == local.token_ids
    http_traffic(http)
    with back_to_back_requests(http) as replies:  # one is running whenever the drain begins
        down = tandem("down", "--name", "cli-test", "--drain")
    assert down.returncode == 0 and "stopped (and the local Ray it started)" in down.stderr, down.stderr
    running = re.search(r"draining: (\d+) request\(s\) running; no new requests", down.stderr)
    assert running and int(running.group(1)) >= 1, down.stderr
    assert "drained: every request finished" in down.stderr
    finished = [r for r in replies if isinstance(r, dict)]
    assert finished and all(r["usage"]["completion_tokens"] == LONG_TOKENS for r in finished)
    for refused in (r for r in replies if not isinstance(r, dict)):  # after the drain began: refused, never cut
        assert (isinstance(refused, urllib.error.HTTPError) and refused.code == 503
                and refused.headers["Retry-After"] == "1") or isinstance(refused.reason, ConnectionRefusedError), \
            refused
    assert_stopped(head, grpc, http)

    # 2. Right away, on the same ports: a foreground up, traffic, a frozen GCS, SIGTERM.
    assert in_time_wait(http)  # what made the old port check refuse
    log = tmp_path / "up.log"
    with foreground_up(manifest, log) as (foreground, head):
        http_traffic(http)
        freeze_gcs(head)
        foreground.send_signal(signal.SIGTERM)
        assert foreground.wait(timeout=60) == 0, log.read_text()
    assert "tandem: stopping" in log.read_text()
    assert_stopped(head, grpc, http)

    # 3. SIGHUP while it starts: what was started is stopped.
    with foreground_up(manifest, log, until="decode-0: placing") as (foreground, head):
        foreground.send_signal(signal.SIGHUP)
        assert foreground.wait(timeout=120) == 130, log.read_text()
    assert "interrupted while starting; stopping what was started" in log.read_text()
    assert_stopped(head, grpc, http)

    # 4. A GCS that stops answering (and would ignore SIGTERM): `tandem down` still stops the head.
    up = tandem("up", str(manifest), "--detach")
    assert up.returncode == 0 and "starting a local Ray head on 127.0.0.1" in up.stderr, up.stderr
    head = local_ray.recorded()
    http_traffic(http)
    freeze_gcs(head)
    down = tandem("down", "--name", "cli-test", timeout=60)
    assert down.returncode == 0, down.stderr
    assert f"the Ray head tandem started at {head.gcs_address} does not answer; ended its" in down.stderr
    assert_stopped(head, grpc, http)


def test_status_without_a_cluster_says_so():
    done = tandem("status", timeout=60)
    assert done.returncode == 1
    assert "no Ray cluster" in done.stderr or "no tandem cluster" in done.stderr
