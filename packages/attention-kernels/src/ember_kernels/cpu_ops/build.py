"""Builds the C++ CPU kernels on first use and caches the library per user, source and CPU.

The library is compiled with ``-O3 -march=native`` for the CPU it runs on, so the cache key holds
the CPU's model and feature flags besides the source, torch, Python and compiler versions: a
cache shared between machines (a network home) never hands one CPU's build to another. Later
processes import the cached library directly (no compiler call). Where no compiler works, the
torch path is used and one warning line says why. The sources include only the ATen and pybind11
headers they use (not ``torch/extension.h``): that took the compiler's time from about 72 to
about 30 CPU-seconds.

An engine need not wait for a first build: ``start_background_build`` imports a cached library at
once, or else compiles it in a daemon thread while the torch path serves (``cpu_ops.one_step``
keeps each step on one path). Each build compiles in a folder of its own process and renames the
finished library into the cache, so a build killed midway (a server stopped during its first
start) leaves no half-written library and never meets another process's compiler.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import threading
import time

import torch

logger = logging.getLogger("ember_kernels")

_HERE = pathlib.Path(__file__).parent
SOURCES = [
    _HERE / name
    for name in (
        "paged_attention.cpp",
        "fused_ops.cpp",
        "argmax.cpp",
        "int8_linear.cpp",
        "int8_gemv.cpp",
        "lora.cpp",
        "moe.cpp",
        "w8a8_linear.cpp",
        "decoder_stack.cpp",
        "packed_layout.cpp",
        "packed_gemv.cpp",
        "amx_gemm.cpp",
        "bindings.cpp",
    )
]
HEADERS = [
    _HERE / name
    for name in (
        "kernels.h",
        "vec.h",
        "bf16_dot.h",
        "paged_attention_common.h",
        "attend_columns.h",
        "int8_gemv.h",
        "amx_gemm.h",
        "packed_layout.h",
        "group_shares.h",
    )
]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
_lock = threading.Lock()  # held while the library is settled (imported or built)
_start_lock = threading.Lock()  # held while a background build is started
_state: dict[str, object] = {}


def cache_root() -> pathlib.Path:
    """``$EMBER_KERNELS_CACHE``, else ``$XDG_CACHE_HOME/ember-kernels``, else ~/.cache/..."""
    if "EMBER_KERNELS_CACHE" in os.environ:
        return pathlib.Path(os.environ["EMBER_KERNELS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "ember-kernels"


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), else the platform's description."""
    try:
        fields = {}
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        return f"{fields.get('model name')}|{fields.get('flags')}"
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} is not on PATH)")
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()[0]


def _loaded_libstdcxx() -> str | None:
    """The path of the C++ runtime this process already runs on (torch loads it), if any.

    The library links it by path: a toolchain that links the C++ runtime statically (``CXX``
    set to a compiler of its own) would otherwise copy the runtime in, and that second copy's
    locale is never set up, so formatting any error message (every refused argument) crashes
    the process."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: the platform's toolchain links its runtime as usual
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        if len(fields) == 6 and pathlib.Path(fields[5]).name.startswith("libstdc++.so"):
            return fields[5]
    return None


def _link_flags() -> list[str]:
    runtime = _loaded_libstdcxx()
    return ["-fopenmp", *([runtime] if runtime else [])]


def _build_key() -> str:
    digest = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in SOURCES + HEADERS),
        " ".join(CFLAGS + _link_flags()).encode(),
        torch.__version__.encode(),
        sys.version.encode(),
        _compiler_version().encode(),
        _cpu_identity().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _import_library(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, directory: pathlib.Path):
    """Compile in a folder of this process's own, then rename the library into ``directory``,
    under an ``flock`` of ``directory`` that the kernel releases if this process dies (torch's
    own lock is a plain file that a killed build leaves behind)."""
    import fcntl

    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    with open(directory / "build.lock", "w") as build_lock:
        fcntl.flock(build_lock, fcntl.LOCK_EX)
        if library.exists():  # another process built it while this one waited
            return _import_library(name, library)
        for stale in directory.glob("build-*"):  # left by killed builds (the lock is ours)
            shutil.rmtree(stale, ignore_errors=True)
        workdir = directory / f"build-{os.getpid()}"
        workdir.mkdir()
        # A warning, so that it reaches stderr where logging was never configured (a first start
        # otherwise sits silent while the compiler runs); ninja compiles the sources in parallel.
        logger.warning(
            "ember_kernels: compiling the CPU kernels for this CPU into %s (once; %d sources "
            "in parallel, some seconds)",
            directory,
            len(SOURCES),
        )
        start = time.perf_counter()
        module = load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=_link_flags(),
            build_directory=str(workdir),
            verbose=False,
        )
        os.replace(workdir / f"{name}.so", library)  # atomic: whole or absent
        shutil.rmtree(workdir, ignore_errors=True)
        logger.warning("ember_kernels: CPU kernels compiled in %.1f s", time.perf_counter() - start)
        return module


def _library_path() -> tuple[str, pathlib.Path]:
    """The library's module name and its path in the cache (which may not exist yet)."""
    key = _build_key()
    name = f"ember_cpu_kernels_{key}"
    return name, cache_root() / key / f"{name}.so"


def load_library():
    """The compiled kernels' module, built if needed; None (logged once) where it cannot be."""
    if "module" in _state:  # every kernel call asks: no lock once it is settled
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        try:
            name, library = _library_path()
            module = (
                _import_library(name, library) if library.exists() else _build(name, library.parent)
            )
        except Exception as exc:  # no compiler, a failed build or load: the torch path serves
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            logger.warning(
                "ember_kernels: compiled CPU kernels unavailable (%s); using the torch path",
                reason,
            )
        _state["module"] = module
        return module


def start_background_build() -> None:
    """Settle the library without making the caller wait for a compiler: a cached library is
    imported now (a fraction of a second); otherwise a daemon thread builds it, and from here on
    ``cpu_ops.one_step`` in this process asks whether it is ready instead of waiting for it
    (``load_library`` and ``cpu_ops.available`` outside a step still wait). Idempotent."""
    with _start_lock:
        if "module" in _state or "builder" in _state:
            return
        try:
            cached = _library_path()[1].exists()
        except Exception:  # no compiler: load_library logs why, at once
            cached = True
        if cached:
            load_library()
            return
        logger.warning(
            "ember_kernels: the CPU kernels are not built for this CPU yet; building them in the "
            "background (the torch path serves until they are ready)"
        )
        builder = threading.Thread(target=_build_then_log, name="ember-kernels-build", daemon=True)
        _state["builder"] = builder
        builder.start()


BACKGROUND_NICE = 10  # added niceness: the compiler yields the cores to the engine beside it


def _build_then_log() -> None:
    # Linux: this thread's niceness, which the compiler processes it starts inherit.
    with contextlib.suppress(AttributeError, OSError):
        thread = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICE
        os.setpriority(os.PRIO_PROCESS, thread, min(19, nice))
    if load_library() is not None:
        logger.warning("ember_kernels: CPU kernels ready; steps from now on use them")


def building_in_background() -> bool:
    """Whether ``start_background_build`` started a build in this process (finished or not)."""
    return "builder" in _state


def building_now() -> bool:
    """Whether a background build started by ``start_background_build`` is still running."""
    return "builder" in _state and "module" not in _state


def settled_library():
    """The library if settled and built, else None; never waits (see ``load_library``)."""
    return _state.get("module")
