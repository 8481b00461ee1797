"""deploy/lent-gpu: what a lent GPU machine is sent. Its packages are the lock's versions (a lock change that drops
or renames one fails here, not on the machine's few minutes), and its stage script parses."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "deploy" / "lent-gpu"


def _prepare():
    spec = importlib.util.spec_from_file_location("lent_gpu_prepare", FOLDER / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_package_sent_is_pinned_by_the_lock():
    prepare = _prepare()
    versions = prepare.locked_versions()
    sent = [name for names in prepare.PART_WHEELS.values() for name in names] + list(prepare.TRIM)
    assert len(sent) == len(set(sent))
    missing = [name for name in sent if name not in versions and name != "cuda-bindings"]
    assert not missing, f"not in requirements/lock.txt: {missing}"
    assert versions["ray"] == "2.60.0" and prepare.CUDA_BINDINGS.startswith("12.")


def test_the_stage_script_parses_and_has_the_three_stages():
    assert subprocess.run(["bash", "-n", str(FOLDER / "run.sh")]).returncode == 0
    text = (FOLDER / "run.sh").read_text()
    assert all(f"\n{stage})\n" in text for stage in (1, 2, 3))


def test_unpacked_wheels_keep_their_executables_runnable(tmp_path):
    """Ray's wheel carries its gcs_server and raylet binaries as 0755 entries: unpacked, they must still run."""
    import stat
    import zipfile

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, mode in (("demo/bin/server", 0o755), ("demo/data.txt", 0o644)):
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | mode) << 16
            z.writestr(info, "x")
    _prepare().unpack_wheel(wheel, tmp_path / "tree")
    assert (tmp_path / "tree/demo/bin/server").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "tree/demo/data.txt").stat().st_mode & 0o777 == 0o644
