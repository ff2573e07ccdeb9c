"""Lock-step data-parallel engine cores (``-dp 2 --enable-expert-parallel``) when one of them, or a
worker rank of one, is killed: the other's collectives lose their peer, so every request ends with
a 503 naming the dead engine core, the server reports itself unhealthy, and no engine core or
worker process stays behind. Nothing restarts: a new engine could not rejoin the group."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_thread import ServerThread
from test_http_worker_death import assert_gone, children_of, error_after_killing

from ember_server.engine.engine_args import EngineArgs

pytestmark = pytest.mark.slow

TIMEOUT = 60  # bounds every wait: a hang fails the test instead of blocking


@pytest.mark.parametrize("victim", ["engine", "worker"])
def test_a_killed_engine_or_rank_fails_every_request_and_leaves_no_process(tiny_model, victim):
    args = EngineArgs(
        model=str(tiny_model("mixtral")),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory=2**21,
        num_threads=1,
        data_parallel_size=2,
        enable_expert_parallel=True,
    )
    with ServerThread(args) as server:
        engines = [client.pid for client in server.engine.clients]
        workers = [pid for engine in engines for pid in children_of(engine)]
        assert len(workers) == 2, workers  # one rank per engine core
        base = f"{server.base_url}/v1"

        def idle_victim() -> int:
            # One request, on one engine core; the other runs only the experts' collectives.
            busy = next(e for e, load in enumerate(server.engine.router.loads) if load)
            idle = engines[1 - busy]
            return idle if victim == "engine" else children_of(idle)[0]

        with httpx.Client(timeout=TIMEOUT) as http:
            error = error_after_killing(http, base, idle_victim)
            assert error["code"] == 503 and "engine core" in error["message"], error
            assert http.get(f"{server.base_url}/health").status_code == 503
            late = http.post(f"{base}/completions", json={"prompt": "x", "max_tokens": 2})
            assert late.status_code == 503
        assert server.engine.recovery.num_restarts == 0
    assert_gone([*engines, *workers], TIMEOUT)


def test_an_engine_killed_at_start_up_fails_the_start_and_leaves_no_worker(tiny_model):
    """The other engine's workers wait at the shared rendezvous for ranks that never come; they
    go with their engine core when the failed start stops it (``mp_worker.exit_with_parent``),
    not when the rendezvous times out."""
    import asyncio

    from ember_server.engine.async_llm import AsyncLLM
    from ember_server.engine.core_client import EngineStartupError, launch_engines

    args = EngineArgs(
        model=str(tiny_model("mixtral")), dtype="float32", max_model_len=256,
        kv_cache_memory=2**21, num_threads=1, data_parallel_size=2, enable_expert_parallel=True,
    )  # fmt: skip
    clients = launch_engines(args)
    deadline = time.monotonic() + TIMEOUT
    workers: list[int] = []
    while len(workers) < 2 and time.monotonic() < deadline:
        workers = [pid for client in clients for pid in children_of(client.pid)]
        time.sleep(0.1)
    assert len(workers) == 2, workers
    os.kill(clients[1].pid, signal.SIGKILL)
    with pytest.raises(EngineStartupError, match="during start-up"):
        asyncio.run(AsyncLLM.start(args, clients=clients))
    assert_gone(workers, TIMEOUT)
