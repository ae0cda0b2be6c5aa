"""Generate the client's stub copy (specrpc_client/_gen) whenever setuptools builds the package."""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProto(build_py):
    """build_py that first writes specrpc_client/_gen/*_pb2*.py from ../../proto."""

    def run(self) -> None:
        runpy.run_path(str(Path(__file__).resolve().parent / "gen_stubs.py"))["generate"]()
        super().run()


setup(cmdclass={"build_py": BuildWithProto})
