"""When the engine core process dies, requests in flight fail fast, ``/health`` turns 503 and the
gauges of ``/metrics`` drop to zero (``ember serve`` then exits 1: see test_serve_lifecycle.py)."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs

# Every wait below is bounded by this client timeout: a hang fails the test instead of blocking.
TIMEOUT = 30


@pytest.fixture
def server(tiny_model):
    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory=2**21,
        max_engine_restarts=0,  # fail-stop: requests fail, nothing restarts
    )
    with ServerThread(args) as running:
        yield running


def test_killed_engine_fails_requests_and_health(server):
    base = f"{server.base_url}/v1"
    body = dict(prompt="def main(argv):", max_tokens=1000, ignore_eos=True)  # outlasts the kill
    whole: dict[str, httpx.Response] = {}

    def post_whole() -> None:
        whole["response"] = httpx.post(f"{base}/completions", json=body, timeout=TIMEOUT)

    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", f"{base}/completions", json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            waiter = threading.Thread(target=post_whole)
            waiter.start()
            server.wait_for_metric("ember:num_requests_running", lambda v: v >= 2)
            os.kill(server.engine.engine_core_pid, signal.SIGKILL)
            events = [first, *(line for line in lines if line.startswith("data:"))]
        waiter.join(TIMEOUT)

    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][5:])["error"]
    assert error["code"] == 503 and "engine" in error["message"]
    response = whole["response"]
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"

    # The gauges no longer show the requests that were running, nor their KV blocks.
    assert server.metric("ember:num_requests_running") == 0
    assert server.metric("ember:kv_cache_usage_perc") == 0

    health = httpx.get(f"{server.base_url}/health", timeout=TIMEOUT)
    assert health.status_code == 503 and health.json()["error"]["code"] == 503
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for route, extra in (("completions", {"prompt": "x"}), ("chat/completions", chat)):
        for stream in (False, True):
            late = httpx.post(f"{base}/{route}", json={"stream": stream, **extra}, timeout=TIMEOUT)
            assert late.status_code == 503, late.text
            assert late.json()["error"]["type"] == "service_unavailable_error"
