"""The local Ray head `tandem up` starts when no Ray cluster runs (ray.address: null): how it is started, found,
probed and stopped.

1. Loopback. Ray's servers (GCS, raylet, object manager, every worker's gRPC server) bind 127.0.0.1 only when the
   node's IP is 127.0.0.1, and on Linux Ray replaces 127.0.0.1 in a node IP or an address with the machine's
   network IP unless it runs in its single-node mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, its default on macOS
   and Windows). A head on ray.host 127.0.0.1 therefore runs in that mode, and so must every driver that connects
   to it: connect_mode() switches this process before ray.init.
2. Ownership. The head runs in a session of its own (so the signals a terminal or `timeout` sends to tandem's
   process group reach tandem, which stops Ray in order, and not Ray's daemons directly), and tandem notes that
   session and the head's GCS address in <Ray's temp dir>/tandem_head.json. stop() ends the processes of that
   session only, never a Ray cluster tandem did not start: in `ray stop`'s order (raylets, the rest, the GCS
   last: a GCS terminated together with its raylets can hang in its own shutdown and ignore SIGTERM from then
   on), then SIGKILL for whatever is left.
3. Liveness. answers() asks the GCS's gRPC health service with a deadline, so that a dead or hung head named in
   Ray's ray_current_cluster file is noticed in seconds instead of ray.init retrying it forever.
4. Authentication. Ray's servers run code for whoever reaches them (actor calls are pickled), so the head runs
   with Ray's token authentication (RAY_AUTH_MODE=token): start() writes a fresh random token for it, readable by
   this user only, to <Ray's temp dir>/tandem_auth_token and notes its path with the head; every process of the
   head inherits it, and a driver of tandem's connecting to that head uses it (use_head_token), whatever
   RAY_AUTH_* or ~/.ray/auth_token this shell has. A client without the token is refused; answers() says so at
   once (RayAuthRefused, naming where this process's token came from and the fix) instead of ray.init retrying.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from tandem.cluster.manifest_checks import is_loopback

SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch; "0": loopback node IPs stay loopback
PROBE_TIMEOUT_S = 5.0
START_TIMEOUT_S = 300.0
AUTH_MODE_ENV, AUTH_TOKEN_PATH_ENV, AUTH_TOKEN_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"


class RayAuthRefused(RuntimeError):
    """The Ray head refused this process's authentication token (or its lack of one)."""


@dataclass(frozen=True)
class LocalHead:
    """A Ray head tandem started: its GCS address (HOST:PORT), the session id of its processes (the pid of the
    `ray start` that led it), that leader's start time (clock ticks after boot, so that a later process reusing
    the pid is not taken for it) and the boot it belongs to."""

    gcs_address: str
    session_id: int
    leader_start: int
    boot_id: str
    token_path: str = ""  # the head's Ray authentication token ("" for a head started before tandem set one)


def _ray_cli() -> str:
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def _temp_dir() -> Path:
    from ray._common.utils import get_default_ray_temp_dir

    return Path(get_default_ray_temp_dir())


def _note_path() -> Path:
    return _temp_dir() / "tandem_head.json"


def address_file() -> Path:
    """Ray's record of the head `ray.init(address="auto")` connects to (written by `ray start`)."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def current_address() -> str | None:
    """The address a driver on this machine connects to for address None/"auto": RAY_ADDRESS, else the head
    Ray's address file names (which may be dead), else None."""
    return os.environ.get("RAY_ADDRESS") or _file_address()


def _file_address() -> str | None:
    try:
        return address_file().read_text().strip() or None
    except OSError:
        return None


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the GCS at address (HOST:PORT) answers a health check within timeout_s (Ray's TLS and token
    settings from the environment apply, as for any of Ray's clients). Raises RayAuthRefused if it refuses this
    process's token."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = init_grpc_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        # The health service takes anyone; this call takes only a client with the cluster's token (auth on).
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                                                                          timeout=timeout_s)
        return True
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise RayAuthRefused(f"the Ray head at {address} uses Ray's token authentication and refused "
                                 f"{_token_source()}: {auth_fix(address)}") from None
        return False
    finally:
        channel.close()


def _token_source() -> str:
    """Where Ray takes this process's token from, in Ray's order, for an error message."""
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled":
        return f"this process, which sends no token ({AUTH_MODE_ENV}=disabled)"
    if os.environ.get(AUTH_TOKEN_ENV):
        return f"the token in {AUTH_TOKEN_ENV}"
    if os.environ.get(AUTH_TOKEN_PATH_ENV):
        return f"the token in {os.environ[AUTH_TOKEN_PATH_ENV]} ({AUTH_TOKEN_PATH_ENV})"
    default = Path.home() / ".ray" / "auth_token"
    return f"the token in {default}" if default.exists() else f"this process, which has no token ({default} absent)"


def auth_fix(address: str) -> str:
    """How to give this process the token of the head at address."""
    head = recorded()
    if head is not None and head.gcs_address == address and head.token_path:
        return (f"tandem started this head; its token is {head.token_path}, which tandem's own commands use (for "
                f"another client: {AUTH_MODE_ENV}=token {AUTH_TOKEN_PATH_ENV}={head.token_path})")
    return (f"set {AUTH_MODE_ENV}=token and {AUTH_TOKEN_PATH_ENV} to the file holding this cluster's token (or "
            f"{AUTH_TOKEN_ENV}); a stale ~/.ray/auth_token left by another cluster is read when neither is set")


def use_head_token(address: str) -> bool:
    """If address is the head tandem started here, makes this process (and what it starts) use that head's
    token, whatever RAY_AUTH_* or ~/.ray/auth_token say; returns whether it did. Call before answers() and
    ray.init."""
    head = recorded()
    if head is None or head.gcs_address != address or not head.token_path:
        return False
    os.environ[AUTH_MODE_ENV] = "token"
    os.environ[AUTH_TOKEN_PATH_ENV] = head.token_path
    os.environ.pop(AUTH_TOKEN_ENV, None)
    try:  # Ray caches its mode and token per process (as ray.init does when it turns token mode on)
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):
        pass
    return True


def _new_token() -> Path:
    """A fresh random token for a new head, readable by this user only."""
    path = _temp_dir() / "tandem_auth_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def connect_mode(address: str) -> None:
    """Puts this process's Ray in the mode a head at address needs (single-node for a loopback head, see the
    module docstring). Call before ray.init."""
    import ray._private.ray_constants as ray_constants

    default = ray_constants.env_bool(SINGLE_NODE_ENV, not ray_constants.IS_WINDOWS_OR_OSX)  # as Ray sets it
    ray_constants.ENABLE_RAY_CLUSTER = default and not is_loopback(address.rpartition(":")[0])


def ray_processes_running() -> bool:
    """Whether any Ray node process runs on this machine (one of ours or not)."""
    return any(_comm(pid) in ("gcs_server", "raylet") for pid in _pids())


# -- start ---------------------------------------------------------------------------------------------------


def start(resources: dict[str, float], host: str, out: TextIO) -> LocalHead:
    """Starts a Ray head on this machine listening on host (127.0.0.1: loopback only) and offering what the
    manifest needs (logical CPUs at least this machine's cores), with Ray's token authentication under a fresh
    token (see the module docstring); notes it as tandem's. Raises RuntimeError with
    Ray's output if it fails; an interrupted or failed start leaves none of its processes running."""
    cpus = max(os.cpu_count() or 1, int(-(-resources.get("CPU", 0) // 1)))
    gpus = int(-(-resources.get("GPU", 0) // 1))
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    loopback = is_loopback(host)
    node_ip = "127.0.0.1" if loopback else host
    cmd = [_ray_cli(), "start", "--head", f"--node-ip-address={node_ip}", f"--num-cpus={cpus}",
           "--include-dashboard=false", "--disable-usage-stats"]
    if gpus:
        cmd.append(f"--num-gpus={gpus}")
    if custom:
        cmd.append(f"--resources={json.dumps(custom)}")
    token = _new_token()
    env = {k: v for k, v in os.environ.items() if k != AUTH_TOKEN_ENV} | (
        {SINGLE_NODE_ENV: "0"} if loopback else {}) | {AUTH_MODE_ENV: "token", AUTH_TOKEN_PATH_ENV: str(token)}
    print(f"tandem: starting a local Ray head on {node_ip} ({cpus} CPUs{', ' + json.dumps(custom) if custom else ''})",
          file=out, flush=True)
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    head = LocalHead("", process.pid, _start_time(process.pid) or 0, _boot_id(), str(token))
    try:
        output, _ = process.communicate(timeout=START_TIMEOUT_S)
        if process.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{output}")
    except BaseException:  # failed, too slow, or interrupted (Ctrl-C, SIGTERM): leave nothing of it running
        process.kill()
        process.wait()
        _end_session(head, grace_s=2.0)
        raise
    head = LocalHead(_file_address() or f"{node_ip}:6379", head.session_id, head.leader_start, head.boot_id,
                     head.token_path)
    _note_path().write_text(json.dumps(asdict(head)))
    return head


# -- find and stop -------------------------------------------------------------------------------------------


def recorded() -> LocalHead | None:
    """The head tandem last started on this machine (None if none, or if it belonged to an earlier boot)."""
    try:
        head = LocalHead(**json.loads(_note_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return head if head.boot_id == _boot_id() else None


def processes(head: LocalHead) -> list[int]:
    """The live (not zombie) processes of head's session; none if its session id now leads someone else's."""
    leader = _start_time(head.session_id)
    if leader is not None and leader != head.leader_start:
        return []
    return [pid for pid in _pids() if _session(pid) == head.session_id and pid != os.getpid()]


def stop(head: LocalHead, grace_s: float = 10.0) -> int:
    """Ends every process of head's session and forgets the head: tandem's note, and Ray's address file if it
    names this head. Each of the three stages gets SIGTERM and up to grace_s to exit; what is left then gets
    SIGKILL (grace_s 0: SIGKILL at once, for a head whose GCS does not answer). Returns how many processes it
    found."""
    ended = _end_session(head, grace_s)
    if recorded() == head:
        _note_path().unlink(missing_ok=True)
    if _file_address() == head.gcs_address:
        address_file().unlink(missing_ok=True)
    return ended


def forget_address_file() -> None:
    """Removes Ray's address file (call only when it names a head that does not answer)."""
    address_file().unlink(missing_ok=True)


def _end_session(head: LocalHead, grace_s: float) -> int:
    found = len(processes(head))
    stages = [lambda name: name == "raylet", lambda name: name != "gcs_server", lambda name: True] if grace_s else []
    for picks in stages:
        _signal_and_wait([pid for pid in processes(head) if picks(_comm(pid))], signal.SIGTERM, grace_s)
    _signal_and_wait(processes(head), signal.SIGKILL, 5.0)
    return found


def _signal_and_wait(pids: list[int], sig: signal.Signals, wait_s: float) -> None:
    """Sends sig to pids and waits up to wait_s until none of them lives."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while any(_stat(pid) is not None for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


# -- /proc ---------------------------------------------------------------------------------------------------


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (field 3, state, onwards); None if gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _session(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[3]) if fields else None  # field 6, session


def _start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22, starttime


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
