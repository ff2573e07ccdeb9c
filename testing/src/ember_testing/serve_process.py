"""``ember serve`` as a real child process, for tests of what a user or an orchestrator sees
(start-up, signals, exit status, and what the server leaves behind: processes, socket folders),
and for the benchmarks that measure a served engine: waiting for it to serve, stopping it."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

START_TIMEOUT = 300.0  # importing torch twice on a loaded small machine can take a minute


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s children (from /proc)."""
    found = []
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nPPid:\t{pid}\n" in text:
            found.append(int(status.parent.name))
    return found


def is_running(pid: int) -> bool:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its reaping is pending


def wait_gone(pids: list[int], timeout: float = 30.0) -> bool:
    """Whether every process in ``pids`` has exited within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(is_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_serving(
    process: subprocess.Popen, ready: Callable[[], bool], timeout: float, interval: float = 0.05
) -> None:
    """Poll ``ready()`` (an HTTP probe; a transport error counts as not yet) until it is true.

    Raises RuntimeError if ``process`` exits first, and TimeoutError, having killed it, if
    ``timeout`` seconds pass.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"ember serve exited with code {process.returncode}")
        try:
            if ready():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise TimeoutError(f"ember serve did not answer within {timeout:.0f} s")
        time.sleep(interval)


def is_healthy(base_url: str) -> Callable[[], bool]:
    """A ``wait_serving`` probe: the server's ``/health`` answers 200."""
    return lambda: httpx.get(f"{base_url}/health", timeout=5).status_code == 200


def stop(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop ``ember serve`` as a user does, with Ctrl-C (SIGINT); kill it if it has not exited
    within ``timeout`` seconds."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class ServeProcess:
    """``with ServeProcess(args, tmp_path) as server:`` runs ``ember serve *args`` on a free port.

    The child's temp dir is ``tmp_path / "tmp"`` (``socket_folders()`` lists the engine's IPC
    socket folders there) and its output goes to ``tmp_path / "server.log"``. On exit a process
    still running is killed, engine included.
    """

    def __init__(self, args: list[str], tmp_path: pathlib.Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir(exist_ok=True)
        self.log = tmp_path / "server.log"
        self.command = [sys.executable, "-m", "ember_server", "serve", "--port", str(self.port)]
        self.command += args
        self.process: subprocess.Popen | None = None
        self.engine_pids: list[int] = []

    def start(self) -> None:
        """Start the process without waiting for it to serve."""
        env = {**os.environ, "TMPDIR": str(self.tmpdir)}
        with self.log.open("w") as sink:
            self.process = subprocess.Popen(
                self.command, stdout=sink, stderr=subprocess.STDOUT, env=env
            )

    def __enter__(self) -> ServeProcess:
        self.start()
        try:
            wait_serving(self.process, is_healthy(self.base_url), START_TIMEOUT, interval=0.2)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}:\n{self.log.read_text()}") from None
        self.engine_pids = child_pids(self.process.pid)
        return self

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.process.wait(timeout)

    def socket_folders(self) -> list[pathlib.Path]:
        return sorted(self.tmpdir.glob("ember-engine-*"))

    def __exit__(self, *exc_info) -> None:
        for pid in [self.process.pid, *self.engine_pids]:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
