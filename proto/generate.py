"""Regenerates the Python code of proto/v1/tandem.proto (run after editing it): `python -m tandem.proto.generate`.

The generated modules import each other as `tandem.proto.v1.*`, so protoc runs over a staging tree laid out as
that package path; the results are copied next to the .proto file and committed (tests/proto checks they match).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "v1" / "tandem.proto"
OUTPUTS = ("tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Writes the generated modules into out_dir; returns their paths. Raises RuntimeError if protoc fails."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "tandem" / "proto" / "v1"
        staged.mkdir(parents=True)
        shutil.copy(SOURCE, staged / SOURCE.name)
        include = Path(protoc.__file__).parent / "_proto"
        code = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"-I{include}", f"--python_out={tmp}",
                            f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", "tandem/proto/v1/tandem.proto"])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            shutil.copy(staged / name, out_dir / name)
            written.append(out_dir / name)
        return written


if __name__ == "__main__":
    for path in generate(HERE / "v1"):
        print(path, file=sys.stderr)
