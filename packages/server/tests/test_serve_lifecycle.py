"""``ember serve`` as an orchestrator treats it: SIGTERM and SIGINT with streams in flight, and the
engine core dying under it. Real processes; each test checks the exit status, that no process is
left, and that the engine's IPC socket folder is gone from the temp dir."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from ember_testing.serve_process import START_TIMEOUT, ServeProcess, child_pids, wait_gone

TIMEOUT = 60  # bounds every wait: a hang fails the test instead of blocking it


def _flags(model: str, *extra: str) -> list[str]:
    return [model, "--max-model-len", "2048", "--kv-cache-memory", "16MiB", "--num-threads", "1",
            "--log-level", "warning", *extra]  # fmt: skip


class _Stream(threading.Thread):
    """One streamed completion read in the background: its SSE data lines, once it has ended."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/v1/completions"
        self.body = dict(prompt="def main(argv):", max_tokens=max_tokens, ignore_eos=True,
                         temperature=0.0, stream=True)  # fmt: skip
        self.started = threading.Event()
        self.events: list[str] = []

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=TIMEOUT) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.events.append(line[5:].strip())
                    self.started.set()

    def finish_reason(self) -> str | None:
        chunks = [json.loads(e) for e in self.events[:-1]]
        return [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]

    def error(self) -> dict | None:
        chunks = [json.loads(e) for e in self.events[:-1]]
        return next((c["error"] for c in chunks if "error" in c), None)


def _start_streams(base_url: str, count: int, max_tokens: int) -> list[_Stream]:
    streams = [_Stream(base_url, max_tokens) for _ in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(TIMEOUT), "the stream never started"
    return streams


def _refuses_connections(base_url: str) -> bool:
    """Whether a new request goes unserved: refused, or (taken from the accept backlog as the
    listener closed) closed without a response."""
    try:
        httpx.get(f"{base_url}/health", timeout=5)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama", max_position_embeddings=2048))


def test_sigterm_lets_streams_in_flight_finish_then_exits_clean(model, tmp_path):
    with ServeProcess(_flags(model, "--shutdown-timeout", "120"), tmp_path) as server:
        assert server.socket_folders() and server.engine_pids
        streams = _start_streams(server.base_url, 2, max_tokens=1500)
        server.signal(signal.SIGTERM)
        # It stops accepting at once, while the streams in flight go on to their end.
        assert any(_refuses_connections(server.base_url) for _ in range(100))
        for stream in streams:
            stream.join(TIMEOUT)
            assert stream.events[-1] == "[DONE]" and stream.error() is None
            assert stream.finish_reason() == "length"
        assert server.wait(TIMEOUT) == 0, server.log.read_text()
        assert wait_gone(server.engine_pids), "the engine core outlived the server"
        assert server.socket_folders() == []


def test_sigint_past_the_grace_period_fails_what_is_left_with_a_clear_error(model, tmp_path):
    with ServeProcess(_flags(model, "--shutdown-timeout", "0.5"), tmp_path) as server:
        (stream,) = _start_streams(server.base_url, 1, max_tokens=2000)
        server.signal(signal.SIGINT)
        stream.join(TIMEOUT)
        assert stream.events[-1] == "[DONE]"
        error = stream.error()
        assert error is not None and error["code"] == 503
        assert "shutting down" in error["message"]
        assert server.wait(TIMEOUT) == 0, server.log.read_text()
        assert wait_gone(server.engine_pids)
        assert server.socket_folders() == []


def test_engine_death_fails_requests_and_exits_nonzero_for_a_restart(model, tmp_path):
    with ServeProcess(_flags(model, "--max-engine-restarts", "0"), tmp_path) as server:
        (stream,) = _start_streams(server.base_url, 1, max_tokens=2000)
        os.kill(server.engine_pids[0], signal.SIGKILL)
        stream.join(TIMEOUT)
        assert stream.error()["code"] == 503
        assert server.wait(TIMEOUT) == 1, server.log.read_text()
        assert server.socket_folders() == []


def test_sigterm_while_the_model_loads_stops_the_start_up_clean(model, tmp_path):
    server = ServeProcess(_flags(model), tmp_path)
    server.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (server.socket_folders() and child_pids(server.process.pid)):
            assert server.process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        engines = child_pids(server.process.pid)
        server.signal(signal.SIGTERM)
        # The exit waits for the front end's tokenizer loading thread, however slow the machine.
        assert server.wait(START_TIMEOUT) == 0, server.log.read_text()
        assert wait_gone(engines)
        assert server.socket_folders() == []
    finally:
        server.__exit__(None, None, None)
