"""The C kernels must build wherever there is a C compiler: every test of them is skipped when
kernels.load_library() gives None, so a source that stops compiling would otherwise pass CI
silently while the engine falls back to its slower torch paths."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cbgen.cpu import build, kernels


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
def test_every_kernel_source_compiles_and_the_library_loads(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    for source, flags in build._SRCS.items():
        done = subprocess.run(
            [cc, *build._FLAGS, *flags, "-c", str(source), "-o", str(tmp_path / "x.o")],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{source.name} does not compile:\n{done.stderr}"
    assert kernels.load_library() is not None
