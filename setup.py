"""Generate the gRPC stubs from proto/ whenever setuptools builds the package (wheel or sdist install)."""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProto(build_py):
    """build_py that first writes specrpc/v1/*_pb2*.py(i) from proto/."""

    def run(self) -> None:
        root = Path(__file__).resolve().parent
        runpy.run_path(str(root / "tools" / "gen_proto.py"))["generate"](root)
        super().run()


setup(cmdclass={"build_py": BuildWithProto})
