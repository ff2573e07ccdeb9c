"""``ember collect-env``: the report a bug needs, with secrets hidden."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys

import torch

from ember_server.cli.collect_env import collect_env


def test_report_names_versions_cpu_and_environment():
    environ = {"EMBER_TINY_MODELS_DIR": "/x", "OMP_NUM_THREADS": "1", "EMBER_API_KEY": "s3cret",
               "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root"}  # fmt: skip
    report = collect_env(environ)
    assert f"Python: {platform.python_version()}" in report
    assert f"torch: {torch.__version__}" in report
    for name in ("transformers", "ember-server", "ember-worker", "ember-kv-cache"):
        assert f"{name}: {importlib.metadata.version(name)}" in report
    assert "triton: " in report  # a version, or "not installed"
    assert f"architecture: {platform.machine()}" in report
    assert f"/ {os.cpu_count()}" in report
    if platform.machine() == "x86_64":
        assert "flags: " in report and " sse2 " in f" {report} "
    assert "OMP_NUM_THREADS: 1" in report and "CUDA_VISIBLE_DEVICES: 0,1" in report
    assert "EMBER_TINY_MODELS_DIR: /x" in report
    assert "EMBER_API_KEY: (set, hidden)" in report and "s3cret" not in report
    assert "HOME" not in report
    if not torch.cuda.is_available():
        assert "GPUs: none visible to torch" in report


def test_collect_env_command_prints_the_report():
    done = subprocess.run(
        [sys.executable, "-m", "ember_server", "collect-env"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EMBER_LOGGING_LEVEL": "info", "EMBER_API_KEY": "s3cret"},
    )
    assert done.returncode == 0, done.stderr
    assert "== Ember packages" in done.stdout and "== torch and GPUs" in done.stdout
    assert "EMBER_LOGGING_LEVEL: info" in done.stdout and "s3cret" not in done.stdout
