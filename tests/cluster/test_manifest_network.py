"""The manifest's addresses as `tandem validate` and `tandem up` check them: listen addresses this machine has,
ports in use (and those a stopped server left in TIME_WAIT, which are free), and the warnings for a router or a
Ray head reachable from other machines."""

from __future__ import annotations

import socket

import pytest

from tandem.cluster.cli import main
from tandem.cluster.manifest_checks import validate_file
from tests.cluster.manifest_files import MANIFESTS, manifest_errors, write_manifest


@pytest.fixture(autouse=True)
def _load_embedded_once(embedded_shape_once):
    """validate_file loads the embedded model's shape once for the session (tests/conftest.py)."""


def _busy_port():
    """A socket listening on a free 127.0.0.1 port (close it when done)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


VALID_ON_PORT = """\
mode: colocated
pools:
  decode: {{}}
listen:
  grpc: 127.0.0.1:{port}
"""


def test_a_listen_address_that_is_not_this_machines_is_reported(tmp_path):
    path = write_manifest(tmp_path, "pools:\n  prefill: {}\n  decode: {}\nlisten: {grpc: '10.255.1.2:50051'}\n")
    [error] = manifest_errors(path, check_ports=True)
    assert error.path == "listen.grpc" and "cannot listen on 10.255.1.2:50051" in error.message


def test_a_listen_port_in_use_is_reported(tmp_path):
    busy, port = _busy_port()
    with busy:
        path = write_manifest(tmp_path, VALID_ON_PORT.format(port=port))
        [error] = manifest_errors(path, check_ports=True)
        assert (error.path, error.line) == ("listen.grpc", 5)
        assert error.message == f"127.0.0.1:{port} is already in use"
        assert "another port" in error.hint
        # The port check is what `--no-port-check` turns off.
        assert validate_file(path, check_ports=False).listen.grpc == f"127.0.0.1:{port}"
    assert validate_file(path, check_ports=True).listen.grpc == f"127.0.0.1:{port}"  # free again


def test_the_http_port_is_checked_like_the_grpc_port(tmp_path):
    busy, port = _busy_port()
    with busy:
        path = write_manifest(tmp_path, "pools:\n  prefill: {}\n  decode: {}\n"
                                f"listen: {{grpc: '127.0.0.1:0', http: '127.0.0.1:{port}'}}\n")
        [error] = manifest_errors(path, check_ports=True)
        assert error.path == "listen.http" and error.message == f"127.0.0.1:{port} is already in use"
    same = write_manifest(tmp_path, "pools:\n  prefill: {}\n  decode: {}\nlisten: {grpc: '127.0.0.1:7000', http: "
                            "'127.0.0.1:7000'}\n", "same.yaml")
    [error] = manifest_errors(same)
    assert error.path == "listen.http" and "also the gRPC address" in error.message


def test_cli_validate_checks_ports_unless_told_not_to(tmp_path, capsys):
    busy, port = _busy_port()
    with busy:
        path = write_manifest(tmp_path, VALID_ON_PORT.format(port=port))
        assert main(["validate", str(path)]) == 2
        assert f"{path}:5: listen.grpc: 127.0.0.1:{port} is already in use" in capsys.readouterr().err
        assert main(["validate", "--no-port-check", str(path)]) == 0
        assert f"{path}: valid (colocated; decode 1x1x1" in capsys.readouterr().out


# --- exposure warnings and ports a stopped server left behind ---------------------------------------------------


def test_a_port_whose_last_connections_are_in_time_wait_is_free():
    """A router that just stopped leaves its side of closed connections in TIME_WAIT; the servers bind with
    SO_REUSEADDR, so the port check must not call the port busy (`tandem up` right after `tandem down`)."""
    from tandem.cluster.manifest_checks import listen_problem

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first, as uvicorn does after a `Connection: close` response
    client.recv(1)
    client.close()
    assert listen_problem(f"127.0.0.1:{port}") is not None  # still listening: busy
    server.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the old check did: TIME_WAIT made it fail
    assert listen_problem(f"127.0.0.1:{port}") is None


EXPOSED = """\
mode: colocated
pools:
  decode: {{}}
listen:
  grpc: {grpc}
  http: {http}
{extra}"""


def test_a_router_open_to_other_machines_without_keys_is_a_warning(tmp_path, capsys):
    from tandem.cluster.manifest_checks import check_file

    path = write_manifest(tmp_path, EXPOSED.format(grpc="0.0.0.0:50051", http="'[::]:8000'", extra=""))
    checked = check_file(path, check_ports=False)
    assert [(w.path, w.line) for w in checked.warnings] == [("listen.grpc", 5), ("listen.http", 6)]
    assert "0.0.0.0:50051 is reachable from other machines and auth.api_keys is empty" in checked.warnings[0].message
    assert "auth.api_keys" in checked.warnings[0].hint
    assert main(["validate", "--no-port-check", str(path)]) == 0  # valid all the same
    captured = capsys.readouterr()
    assert f"tandem: warning: {path}:5: listen.grpc: 0.0.0.0:50051 is reachable" in captured.err
    assert f"{path}: valid" in captured.out
    keyed = write_manifest(tmp_path, EXPOSED.format(grpc="0.0.0.0:50051", http="'[::]:8000'",
                                            extra="auth: {api_keys: [{tenant: a, key: secret-a}]}\n"), "keyed.yaml")
    assert check_file(keyed, check_ports=False).warnings == []
    loopback = write_manifest(tmp_path, EXPOSED.format(grpc="localhost:50051", http="'[::1]:8000'", extra=""), "lo.yaml")
    assert check_file(loopback, check_ports=False).warnings == []
    for shipped in ("local.yaml", "local-colocated.yaml", "local-parallel.yaml"):
        assert check_file(MANIFESTS / shipped, check_ports=False).warnings == []


def test_a_ray_head_beyond_loopback_is_a_warning_and_an_unspecified_address_an_error(tmp_path):
    from tandem.cluster.manifest_checks import check_file

    path = write_manifest(tmp_path, EXPOSED.format(grpc="127.0.0.1:50051", http="null", extra="ray: {host: 10.0.0.5}\n"))
    [warning] = check_file(path, check_ports=False).warnings
    assert (warning.path, warning.line) == ("ray.host", 7)
    assert "listens on 10.0.0.5: whoever reaches its ports can run code" in warning.message
    assert "docs/SECURITY.md" in warning.hint
    anywhere = write_manifest(tmp_path, EXPOSED.format(grpc="127.0.0.1:50051", http="null", extra="ray: {host: 0.0.0.0}\n"),
                      "anywhere.yaml")
    [error] = manifest_errors(anywhere)
    assert (error.path, error.line) == ("ray.host", 7)
    assert "0.0.0.0 is not an address other nodes can reach" in error.message
