"""Chaos soak: mixed streaming load while engine cores and ranks are killed at random, with prefix
caching, a CPU KV tier and n-gram speculation on, under one engine, ``-dp 2`` and ``-tp 2``.

Each configuration takes ``KILLS`` kills a few seconds apart. Every accepted request must finish
with the undisturbed run's text (greedy and seeded sampling alike) or end with a clean error
event; when the load stops the engine holds nothing (running requests and KV usage back to zero);
the front end's memory stays flat; and the server answers a plain route throughout, kills
included. The counts are printed (``-s``) for the README.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import signal
import time

import httpx
import pytest
from server_thread import ServerThread
from test_http_worker_death import children_of

from ember_server.engine.engine_args import EngineArgs

pytestmark = pytest.mark.slow

KILLS = 5  # per configuration; the load runs until the last restart has served a while
KILL_EVERY = (4.0, 8.0)  # seconds between a recovery and the next kill, drawn uniformly
TAIL_SECONDS = 5.0
CLIENTS = 6
PROMPTS = ["def main(argv):", "import numpy as np\n", "class Node:", "The quick brown fox"]
SAMPLING = [
    {"temperature": 0},
    {"temperature": 1.0, "seed": 17, "top_p": 0.9},
    {"temperature": 0.8, "seed": 5, "stop": ["ee"]},
]
TIER = {
    "kv_connector": "TieredConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "chunk_size": 16,
        "tiers": [{"type": "cpu", "max_bytes": 1 << 26}],
    },
}
CONFIGS = {
    "one-engine": {},
    "dp2": {"data_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
}


def _body(prompt: str, sampling: dict) -> dict:
    return {"prompt": prompt, "max_tokens": 120, "stream": True, **sampling}


async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[str, dict | None]:
    """The streamed text, and the error event if the stream ended with one."""
    text, error = "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]
            else:
                text += event["choices"][0]["text"]
    return text, error


def _victims(server: ServerThread, config: dict) -> list[int]:
    engine = server.engine
    pids = [client.pid for client in engine.clients if client.is_alive()]
    if config.get("tensor_parallel_size", 1) > 1:
        pids = [rank for pid in pids for rank in children_of(pid)]
    return pids


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chaos_soak_loses_no_accepted_request(tiny_model, name):
    config = CONFIGS[name]
    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=2**22,
        num_threads=1,
        kv_transfer_config=TIER,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        max_engine_restarts=1000,  # the soak kills far more often than any real crash loop
        **config,
    )
    cases = [(p, i) for p in PROMPTS for i in range(len(SAMPLING))]
    rng = random.Random(name)
    counts = {"requests": 0, "equal": 0, "different": 0, "errors": 0, "kills": 0, "probes": 0}
    with ServerThread(args) as server:

        async def soak() -> float:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
                reference = {}
                for prompt, index in cases:  # the undisturbed run
                    text, error = await _stream(client, _body(prompt, SAMPLING[index]))
                    assert error is None
                    reference[prompt, index] = text
                rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                done = asyncio.Event()

                async def load(worker: int) -> None:
                    local = random.Random(worker)
                    while not done.is_set():
                        prompt, index = local.choice(cases)
                        text, error = await _stream(client, _body(prompt, SAMPLING[index]))
                        counts["requests"] += 1
                        if error is not None:
                            counts["errors"] += 1
                        elif text == reference[prompt, index]:
                            counts["equal"] += 1
                        else:
                            counts["different"] += 1

                async def chaos() -> None:
                    while counts["kills"] < KILLS:
                        await asyncio.sleep(rng.uniform(*KILL_EVERY))
                        victims = _victims(server, config)
                        if victims and server.engine.is_healthy():
                            os.kill(rng.choice(victims), signal.SIGKILL)
                            counts["kills"] += 1
                    await asyncio.sleep(TAIL_SECONDS)
                    done.set()

                async def probe() -> None:  # the server answers throughout
                    while not done.is_set():
                        started = time.monotonic()
                        response = await client.get("/v1/models", timeout=10)
                        assert response.status_code == 200
                        assert time.monotonic() - started < 5
                        counts["probes"] += 1
                        await asyncio.sleep(0.25)

                await asyncio.gather(*(load(w) for w in range(CLIENTS)), chaos(), probe())
                return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_start

        rss_growth_kib = asyncio.run(soak())
        engine = server.engine
        deadline = time.monotonic() + 60
        alive = lambda: all(state["alive"] for state in engine.engine_states())  # noqa: E731
        while not alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.is_healthy() and not engine.errored
        httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        while time.monotonic() < deadline and (
            engine.scheduler_stats.num_running_reqs or engine.scheduler_stats.kv_cache_usage
        ):
            time.sleep(0.1)
        stats = engine.scheduler_stats
        print(f"\nchaos soak {name}: {counts}, restarts {engine.recovery.num_restarts}, "
              f"front-end max RSS growth {rss_growth_kib / 1024:.1f} MiB")  # fmt: skip
    assert counts["kills"] == KILLS and counts["requests"] > 20
    assert counts["different"] == 0, counts
    assert counts["errors"] <= counts["requests"] // 50, counts  # clean errors only, and rare
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
    assert rss_growth_kib < 200 * 1024
