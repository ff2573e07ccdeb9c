"""A real redis-server on a free loopback port, for the Redis tier's tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def start_redis_server(directory) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (no persistence) in ``directory``; returns it and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    pytest.fail(f"redis-server did not listen on port {port}")


@pytest.fixture
def redis_server(tmp_path):
    """(process, url) of a fresh redis-server; killed after the test."""
    process, url = start_redis_server(tmp_path)
    yield process, url
    process.kill()
    process.wait()
