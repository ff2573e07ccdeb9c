"""A tensor-parallel server whose worker process dies: requests end with 503, no process stays.
The same under expert parallelism, where the surviving rank waits in an all-to-all."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

import httpx
import pytest
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs

TIMEOUT = 30  # bounds every wait: a hang fails the test instead of blocking


def children_of(pid: int) -> list[int]:
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def running(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def error_after_killing(http: httpx.Client, base: str, victim) -> dict:
    """Stream one long completion, SIGKILL the pid ``victim()`` names once its first event is in,
    and return the error event the stream ends with (before its ``[DONE]``)."""
    body = dict(prompt="def main(argv):", max_tokens=1000, ignore_eos=True, stream=True)
    with http.stream("POST", f"{base}/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        os.kill(victim(), signal.SIGKILL)
        events = [first, *(line for line in lines if line.startswith("data:"))]
    assert events[-1] == "data: [DONE]"
    return json.loads(events[-2][5:])["error"]


def assert_gone(pids: list[int], timeout: float) -> None:
    """Every process of ``pids`` ends (or is a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, pids))


@pytest.mark.parametrize(
    ("arch", "expert_parallel"), [("llama", False), ("mixtral", True)], ids=["tp", "tp-ep"]
)
def test_killed_worker_fails_requests_and_leaves_no_process(tiny_model, arch, expert_parallel):
    args = EngineArgs(
        model=str(tiny_model(arch)),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory=2**21,
        num_threads=1,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        max_engine_restarts=0,  # fail-stop: requests fail, nothing restarts
    )
    with ServerThread(args) as server:
        engine_pid = server.engine.engine_core_pid
        workers = children_of(engine_pid)
        assert len(workers) == 2, workers
        base = f"{server.base_url}/v1"
        with httpx.Client(timeout=TIMEOUT) as http:
            error = error_after_killing(http, base, lambda: workers[1])
            assert error["code"] == 503 and "worker rank 1" in error["message"], error
            assert http.get(f"{server.base_url}/health").status_code == 503
            late = http.post(f"{base}/completions", json={"prompt": "x", "max_tokens": 2})
            assert late.status_code == 503
        assert_gone([engine_pid, *workers], TIMEOUT)
