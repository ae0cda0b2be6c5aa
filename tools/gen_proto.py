"""Generate the Python gRPC stubs and their .pyi types from proto/ into specrpc/v1/ (git-ignored).

`protoc -Iproto` maps proto/specrpc/v1/*.proto onto the module path specrpc.v1, so the generated absolute imports
(`from specrpc.v1 import generator_pb2`) resolve inside this package without rewriting.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def plugin(name: str) -> str:
    """Absolute path of a protoc plugin installed beside this interpreter (or on PATH)."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: install mypy-protobuf into this environment")
    return found


def generate(root: Path = ROOT, out: Path | None = None) -> list[Path]:
    """Run protoc on every .proto under root/proto; returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    proto_dir = root / "proto"
    out_dir = out or root
    protos = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={plugin('protoc-gen-mypy_grpc')}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated: list[Path] = []
    for rel in protos:
        pkg = out_dir / Path(rel).parent
        (pkg / "__init__.py").touch()
        (pkg / "py.typed").touch()
        generated.extend(sorted(pkg.glob(f"{Path(rel).stem}_pb2*")))
    return generated


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
