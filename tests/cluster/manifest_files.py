"""Manifest files for the tests of tests/cluster/test_manifest*.py: the shipped ones, and written ones with the
errors validation reports for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cluster.manifest_checks import validate_file
from tandem.cluster.manifest_yaml import ManifestInvalid

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "manifests"


def write_manifest(tmp_path: Path, text: str, name: str = "manifest.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def manifest_errors(path: Path, *, check_ports: bool = False) -> list:
    """The errors validate_file reports for path (it must report some)."""
    with pytest.raises(ManifestInvalid) as info:
        validate_file(path, check_ports=check_ports)
    assert info.value.source == str(path)
    return info.value.errors
