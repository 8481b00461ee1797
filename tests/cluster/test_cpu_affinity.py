"""A pool's cpu_affinity as `tandem validate`, `tandem up` and `tandem status` see it: both spellings parse to the
same CPUs and reach the replica's spec; a bad list is an error at its YAML path and line, one that does not split
over a replica's ranks says so; CPUs this machine lacks are a warning (other nodes may have them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cluster.cli import main
from tandem.cluster.commands import _rank_place
from tandem.cluster.manifest_checks import check_file, cpu_affinity_warnings, validate_file
from tandem.cluster.manifest_yaml import ManifestInvalid
from tandem.cluster.replica_plans import replica_plans
from tandem.engine.hardware.cpu_affinity import format_cpus, offered_cpus


@pytest.fixture(autouse=True)
def _load_embedded_once(embedded_shape_once):
    """validate_file loads the embedded model's shape once for the session (tests/conftest.py)."""


def _write(tmp_path: Path, prefill: str, decode: str = "{}", name: str = "manifest.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"pools:\n  prefill: {prefill}\n  decode: {decode}\n")
    return path


def _errors(path: Path) -> list:
    with pytest.raises(ManifestInvalid) as info:
        validate_file(path, check_ports=False)
    return info.value.errors


def test_a_list_and_a_cpulist_string_give_the_same_cpus_and_reach_every_replica(tmp_path):
    path = _write(tmp_path, "{cpu_affinity: [0]}", '{cpu_affinity: "1", replicas: {initial: 2, max: 2}}')
    manifest = validate_file(path, check_ports=False)
    assert (manifest.pools.prefill.cpu_affinity, manifest.pools.decode.cpu_affinity) == ((0,), (1,))
    assert {(plan.name, plan.spec.cpu_affinity) for plan in replica_plans(manifest)} == {
        ("prefill-0", (0,)), ("decode-0", (1,)), ("decode-1", (1,))}  # every replica of a pool: the same CPUs

    split = _write(tmp_path, '{parallelism: {tp: 2}, cpu_affinity: "8,0-3,2,9-11"}', name="split.yaml")
    pool = check_file(split, check_ports=False).manifest.pools.prefill
    assert pool.cpu_affinity == (0, 1, 2, 3, 8, 9, 10, 11)  # sorted, each CPU once; 4 per rank
    assert validate_file(_write(tmp_path, "{}", name="none.yaml"), check_ports=False).pools.prefill.cpu_affinity \
        is None  # the default: no pinning


@pytest.mark.parametrize("value, message", [
    ("[]", "an empty CPU list pins nothing: list at least one CPU, or leave cpu_affinity out (null)"),
    ("[0, -1]", "CPU numbers are 0 or more, got -1"),
    ('"0-"', "'0-' is not a CPU list: expected CPU numbers and ranges such as \"0-3,8\""),
    ('"3-1"', "'3-1' in '3-1' is a reversed range: write it low-high (1-3)"),
    ("[zero]", "CPU numbers are integers, got 'zero'"),
    ("0", 'expected a list of CPU numbers ([0, 1]) or a cpulist string ("0-3,8"), got 0'),
])
def test_a_bad_cpu_list_is_an_error_at_its_path_and_line(tmp_path, value, message):
    path = tmp_path / "manifest.yaml"
    path.write_text(f"pools:\n  prefill:\n    cpu_affinity: {value}\n  decode: {{}}\n")
    [error] = _errors(path)
    assert (error.path, error.line, error.message) == ("pools.prefill.cpu_affinity", 3, message)


def test_a_list_that_does_not_split_over_a_replicas_ranks_is_an_error(tmp_path):
    path = tmp_path / "manifest.yaml"
    path.write_text("pools:\n  prefill:\n    parallelism: {tp: 2}\n    cpu_affinity: [0, 1, 2]\n"
                    "  decode:\n    parallelism: {pp: 2}\n    cpu_affinity: 0-1\n")
    [error] = _errors(path)
    assert (error.path, error.line) == ("pools.prefill.cpu_affinity", 4)
    assert error.message == ("3 CPU(s) (0-2) do not split evenly over a replica's 2 ranks (tp x pp x ep): list a "
                             "multiple of 2 CPUs, the same number for each rank")
    assert main(["validate", "--no-port-check", str(path)]) == 2


def test_cpus_this_machine_lacks_are_a_warning_not_an_error(tmp_path, capsys):
    absent = max(offered_cpus()) + 1
    path = tmp_path / "manifest.yaml"
    path.write_text(f"pools:\n  prefill: {{}}\n  decode:\n    cpu_affinity: [0, {absent}, {absent + 1}]\n")
    [warning] = check_file(path, check_ports=False).warnings
    assert (warning.path, warning.line) == ("pools.decode.cpu_affinity", 4)
    assert warning.message.startswith(f"CPU(s) {absent}-{absent + 1} are not on this machine, which offers CPUs "
                                      f"{format_cpus(offered_cpus())}")
    assert "nodes that have them" in warning.hint
    assert main(["validate", "--no-port-check", str(path)]) == 0
    captured = capsys.readouterr()
    assert f"tandem: warning: {path}:4: pools.decode.cpu_affinity: CPU(s) {absent}-{absent + 1}" in captured.err
    assert f"{path}: valid" in captured.out
    manifest = check_file(path, check_ports=False).manifest
    assert cpu_affinity_warnings(manifest, offered=frozenset(range(absent + 2))) == []


def test_status_shows_each_ranks_gpus_and_cpus():
    assert _rank_place({"rank": 0, "visible_gpus": None, "cpus": [0]}) == ", CPUs 0"
    assert _rank_place({"rank": 1, "visible_gpus": "3", "cpus": [4, 5, 6, 8]}) == ", GPU 3, CPUs 4-6,8"
    assert _rank_place({}) == ""  # a replica that has not reported yet
