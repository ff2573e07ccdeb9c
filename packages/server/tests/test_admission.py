"""Admission control over HTTP: a full waiting queue is refused with a 503 and Retry-After while
the running request keeps streaming, and a request past its deadline ends cleanly (408, or an
error event in a stream) with its KV blocks freed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs

TIMEOUT = 60
LONG = {"prompt": "hello", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _args(tiny_model, **overrides) -> EngineArgs:
    return EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory=2**22,
        **overrides,
    )


def _wait_for(condition, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_a_full_waiting_queue_gets_503_with_retry_after_while_the_running_stream_goes_on(
    tiny_model,
):
    # One request runs at a time, one may wait: a third is refused.
    args = _args(tiny_model, max_num_seqs=1, max_num_waiting_requests=1)
    with ServerThread(args) as server:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as client:
                running = {**LONG, "stream": True}
                async with client.stream("POST", "/v1/completions", json=running) as first:
                    lines = first.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")  # it runs
                    waiting = asyncio.ensure_future(
                        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    )
                    await asyncio.to_thread(_wait_for, lambda: server.engine.admission.num_waiting)
                    refused = await client.post(
                        "/v1/completions", json={"prompt": "hey", "max_tokens": 2}
                    )
                    assert refused.status_code == 503, refused.text
                    assert int(refused.headers["retry-after"]) >= 1
                    error = refused.json()["error"]
                    assert error["type"] == "service_unavailable_error"
                    assert "max-num-waiting-requests" in error["message"]
                    chunks = [
                        json.loads(line.removeprefix("data: "))
                        async for line in lines
                        if line.startswith("data: {")
                    ]
                    # The running stream went on to its end.
                    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                assert (await waiting).status_code == 200

        asyncio.run(scenario())


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(_args(tiny_model, request_timeout=60.0)) as running:
        yield running


def test_a_request_past_its_deadline_ends_with_408_and_frees_its_blocks(server):
    url = f"{server.base_url}/v1/completions"
    response = httpx.post(url, json={**LONG, "timeout": 0.3}, timeout=TIMEOUT)
    assert response.status_code == 408, response.text
    error = response.json()["error"]
    assert error["param"] == "timeout" and "deadline" in error["message"]

    with httpx.stream("POST", url, json={**LONG, "timeout": 0.3, "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == 408

    _wait_for(lambda: server.engine.scheduler_stats.num_running_reqs == 0)
    _wait_for(lambda: server.engine.scheduler_stats.kv_cache_usage == 0.0)
    ok = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, timeout=TIMEOUT)
    assert ok.status_code == 200  # the server default (60 s) leaves it alone


@pytest.mark.parametrize("timeout", [0, -1, "soon"])
def test_a_bad_timeout_is_a_400_naming_the_field(server, timeout):
    body = {"prompt": "hi", "max_tokens": 2, "timeout": timeout}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "timeout"


def test_engine_args_check_the_admission_settings():
    with pytest.raises(ValueError, match="max_num_waiting_requests"):
        EngineArgs(model="m", max_num_waiting_requests=0)
    with pytest.raises(ValueError, match="request_timeout"):
        EngineArgs(model="m", request_timeout=-2.0)
