"""The compiled CPU kernels' build cache, across processes."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from ember_kernels import cpu_ops

LOAD = "from ember_kernels.cpu_ops.build import load_library; assert load_library() is not None"


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")
def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path):
    """A killed build leaves torch's lock file behind (a server stopped during its first start);
    the next process still builds. Here it only relinks: the object files are copied."""
    built = pathlib.Path(cpu_ops.load_library().__file__).parent
    folder = tmp_path / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("*.so", "*lock"))
    (folder / "lock").touch()
    env = {**os.environ, "EMBER_KERNELS_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", LOAD], env=env, timeout=240, check=True)
    assert list(folder.glob("*.so"))
