"""The compiled CPU kernels' build cache, across processes, and building them in the background."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from ember_kernels import cpu_ops
from ember_kernels.cpu_ops import build
from ember_kernels.reference import rms_norm_reference

needs_compiler = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")

# A fresh process on an empty cache: the build starts in the background, a step that began
# before it finished stays on the torch path to its end, later steps get a working library.
BACKGROUND_BUILD = """
import torch
from ember_kernels import cpu_ops
from ember_kernels.cpu_ops import build
from ember_kernels.cpu_ops.build import load_library
cpu_ops.start_background_build()
with cpu_ops.one_step():
    assert not cpu_ops.available()  # building: a step does not wait for it
    assert load_library() is not None  # wait here for the build's end
    assert not cpu_ops.available()  # the step keeps its answer
with cpu_ops.one_step():
    assert cpu_ops.available()
from ember_kernels.reference import rms_norm_reference
x, w = torch.randn(3, 64), torch.randn(64)
torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
"""

WARM_START = """
from ember_kernels import cpu_ops
from ember_kernels.cpu_ops import build
from ember_kernels.cpu_ops.build import building_in_background, settled_library
cpu_ops.start_background_build()
assert not building_in_background() and settled_library() is not None
"""


@needs_compiler
@pytest.mark.slow
def test_a_background_build_on_an_empty_cache_makes_a_working_library(tmp_path):
    """A killed build's folder (torch's lock file in it, a half-written library) is cleared;
    the finished library is renamed into the cache and works."""
    key = pathlib.Path(cpu_ops.load_library().__file__).parent.name
    stale = tmp_path / key / "build-999999999"
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    (stale / f"ember_cpu_kernels_{key}.so").write_bytes(b"\x7fELF half")
    env = {**os.environ, "EMBER_KERNELS_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", BACKGROUND_BUILD],
        env=env,
        timeout=900,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "building them in the background" in done.stderr
    assert sorted(p.name for p in (tmp_path / key).iterdir()) == [
        "build.lock",
        f"ember_cpu_kernels_{key}.so",
    ]


@needs_compiler
def test_a_cached_library_is_imported_at_once_not_in_the_background():
    """With the library in the cache a start neither compiles nor defers: every step of the
    engine runs the compiled kernels."""
    subprocess.run([sys.executable, "-c", WARM_START], timeout=240, check=True)


@needs_compiler
def test_one_step_keeps_its_answer_while_the_build_finishes(monkeypatch):
    library = cpu_ops.load_library()
    settled = [None]
    monkeypatch.setattr(cpu_ops, "building_in_background", lambda: True)
    monkeypatch.setattr(cpu_ops, "settled_library", lambda: settled[0])
    with cpu_ops.one_step():
        assert not cpu_ops.available()
        settled[0] = library  # the build ends mid-step
        assert not cpu_ops.available()
        with cpu_ops.one_step():  # a nested step (a draft model's) keeps the outer answer
            assert not cpu_ops.available()
        assert not cpu_ops.available()
    assert cpu_ops.available()  # outside a step: waits for the library (here: settled)
    with cpu_ops.one_step():
        assert cpu_ops.available()
        x, w = torch.randn(4, 32), torch.randn(32)
        torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_a_step_that_never_asks_loads_nothing(monkeypatch):
    """A GPU engine's steps run inside ``one_step`` too: the CPU kernels are not built for them."""

    def load_library():
        raise AssertionError("loaded")

    monkeypatch.setattr(cpu_ops, "load_library", load_library)
    with cpu_ops.one_step():
        pass
    with pytest.raises(AssertionError, match="loaded"), cpu_ops.one_step():
        cpu_ops.available()


def test_the_background_build_runs_at_a_lower_priority(monkeypatch):
    """Its thread (and so the compilers it starts) is niced; the caller's threads are not."""
    seen = []

    def load_library():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    monkeypatch.setattr(build, "load_library", load_library)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = threading.Thread(target=build._build_then_log)
    worker.start()
    worker.join()
    assert seen == [min(19, before + build.BACKGROUND_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@needs_compiler
@pytest.mark.skipif(build._loaded_libstdcxx() is None, reason="no shared C++ runtime loaded")
def test_the_library_runs_on_the_processs_own_cpp_runtime():
    # A library that carries a static copy of the C++ runtime crashes the process the first time
    # it formats an error message; it must name the shared runtime torch already loaded.
    library = build._library_path()[1]
    dynamic = subprocess.run(
        ["readelf", "--dynamic", str(library)], capture_output=True, text=True, check=True
    ).stdout
    assert "[libstdc++.so" in dynamic
    with pytest.raises(ValueError, match="rows"):
        cpu_ops.set_packed_gemv_max_rows(-1)
