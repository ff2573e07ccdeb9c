"""A dead engine core loses no accepted request: it is restarted (bounded), and its requests move
on as continuations, so each stream finishes whole and equal to an undisturbed run: greedy with
logprobs, seeded sampling, a stop string, n = 2 and a structured output; one engine restarted,
or data parallel with the other engine taking over, or a TP group restarted after a rank died."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from server_thread import ServerThread
from test_http_worker_death import children_of

from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_server.engine import recovery
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.core_client import EngineDeadError
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.recovery import RestartBudget

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
}
REQUESTS = {
    "greedy": (
        "def main(argv):",
        SamplingParams(temperature=0, max_tokens=400, logprobs=2, ignore_eos=True),
    ),
    "seeded": (
        "import os",
        SamplingParams(temperature=1.0, seed=11, max_tokens=400, ignore_eos=True),
    ),
    "stop": ("class A:", SamplingParams(temperature=1.0, seed=5, max_tokens=300, stop=["ee"])),
    "n2": ("x = 1", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=400, ignore_eos=True)),
    "json": (
        "{",
        SamplingParams(
            temperature=1.0,
            seed=2,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        ),
    ),
}


def _args(tiny_model, **overrides) -> EngineArgs:
    return EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=2**22,
        num_threads=1,
        **overrides,
    )


async def _collect(engine: AsyncLLM, name: str, request_id: str, seen: dict) -> dict:
    """The stream's whole result per sequence: token ids, text, logprobs, finish reason."""
    prompt, params = REQUESTS[name]
    result: dict[int, dict] = {}
    async for out in engine.generate(prompt, params, request_id):
        for seq in out.outputs:
            entry = result.setdefault(seq.index, {"ids": [], "text": "", "logprobs": []})
            entry["ids"] += seq.token_ids
            entry["text"] += seq.text
            entry["logprobs"] += seq.logprobs or []
            entry["finish"] = seq.finish_reason
        seen[request_id] = sum(len(e["ids"]) for e in result.values())
    return result


def _all_started(seen: dict) -> bool:
    return len(seen) == len(REQUESTS) and min(seen.values()) >= 4


async def _run_all(engine: AsyncLLM, tag: str, kill=None, ready=_all_started) -> dict:
    """Run every request of ``REQUESTS`` at once; ``kill()`` once ``ready(tokens seen so far
    per request id)``."""
    seen: dict[str, int] = {}
    tasks = {
        name: asyncio.ensure_future(_collect(engine, name, f"{tag}-{name}", seen))
        for name in REQUESTS
    }
    if kill is not None:
        while not ready(seen):
            await asyncio.sleep(0.002)
        kill()
    return {name: await asyncio.wait_for(task, 120) for name, task in tasks.items()}


def _same(moved: dict, reference: dict) -> None:
    for name, sequences in reference.items():
        for index, want in sequences.items():
            got = moved[name][index]
            assert got["ids"] == want["ids"], name
            assert got["text"] == want["text"], name
            assert got["finish"] == want["finish"], name
            for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
                assert a.keys() == b.keys()
                for token in a:
                    assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_one_engine_is_restarted_and_every_stream_finishes_whole_and_equal(tiny_model):
    async def run():
        engine = await AsyncLLM.start(_args(tiny_model))
        try:
            reference = await _run_all(engine, "ref")
            first_pid = engine.engine_core_pid
            held = []

            def kill():
                held.extend(engine.router.requests_on(0))
                _kill(first_pid)

            moved = await _run_all(engine, "moved", kill=kill)
            assert held  # the dead engine had requests in flight
            _same(moved, reference)
            assert engine.engine_core_pid != first_pid and engine.is_healthy()
            assert engine.recovery.num_restarts == 1 and not engine.errored
            assert b'ember:engine_core_restarts_total{engine="0"' in engine.metrics.render()
            # Nothing leaked: the restarted engine is idle and holds no KV once all finished.
            await asyncio.sleep(0.5)
            assert engine.scheduler_stats.num_running_reqs == 0
            assert engine.scheduler_stats.kv_cache_usage == 0.0
        finally:
            await engine.shutdown()

    asyncio.run(run())


@pytest.mark.slow
def test_data_parallel_moves_a_dead_engines_requests_to_the_live_one(tiny_model):
    async def run():
        engine = await AsyncLLM.start(_args(tiny_model, data_parallel_size=2))
        try:
            reference = await _run_all(engine, "ref")
            victim = engine.clients[1].pid
            held = []

            def kill():
                held.extend(engine.router.requests_on(1))
                _kill(victim)

            def victim_busy(seen: dict) -> bool:
                return any(seen.get(r, 0) >= 4 for r in engine.router.requests_on(1))

            moved = await _run_all(engine, "moved", kill=kill, ready=victim_busy)
            assert held  # the dead engine had requests in flight
            _same(moved, reference)
            assert b'reason="migrated"' in engine.metrics.render()
            states = engine.engine_states()
            assert all(state["alive"] for state in states)  # engine 1 came back too
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_crash_loop_is_stopped_by_the_restart_bound(tiny_model):
    async def run():
        engine = await AsyncLLM.start(_args(tiny_model, max_engine_restarts=1))
        try:
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            _kill(engine.engine_core_pid)
            await asyncio.wait_for(_until(lambda: engine.recovery.num_restarts == 1), 60)
            stream = engine.generate("def f(", params, "doomed")
            first = await anext(stream)
            assert first.outputs
            _kill(engine.engine_core_pid)  # the second death in the window: no more restarts
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            await asyncio.wait_for(engine.wait_until_dead(), 10)
            assert engine.errored and not engine.is_healthy()
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_request_moved_too_often_fails_with_a_clear_error(tiny_model, monkeypatch):
    monkeypatch.setattr(recovery, "MAX_MIGRATIONS", 0)

    async def run():
        engine = await AsyncLLM.start(_args(tiny_model))
        try:
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            stream = engine.generate("def f(", params, "unlucky")
            assert (await anext(stream)).outputs
            _kill(engine.engine_core_pid)
            with pytest.raises(EngineDeadError, match="moved to another engine core"):
                async for _ in stream:
                    pass
            await asyncio.wait_for(_until(lambda: engine.is_healthy()), 60)
            assert not engine.errored  # the engine came back; only that request failed
        finally:
            await engine.shutdown()

    asyncio.run(run())


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.02)


def test_restart_budget_backs_off_and_runs_out_within_its_window():
    now = [0.0]
    budget = RestartBudget(3, window=100.0, clock=lambda: now[0])
    assert [budget.take(), budget.take(), budget.take()] == list(recovery.RESTART_BACKOFF[:3])
    assert budget.take() is None
    now[0] = 150.0  # the old restarts left the window
    assert budget.take() == recovery.RESTART_BACKOFF[0]


def test_health_is_503_while_restarting_and_back_within_15_s_over_http(tiny_model):
    with ServerThread(_args(tiny_model)) as server:
        health = f"{server.base_url}/health"
        assert httpx.get(health, timeout=30).status_code == 200
        _kill(server.engine.engine_core_pid)
        killed = time.monotonic()
        codes = set()
        while time.monotonic() - killed < 15:
            code = httpx.get(health, timeout=30).status_code
            codes.add(code)
            if code == 200 and server.engine.recovery.num_restarts == 1:
                break
            time.sleep(0.05)
        assert 503 in codes and code == 200, codes
        body = {"prompt": "hi", "max_tokens": 3}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).is_success


@pytest.mark.slow
def test_a_dead_tensor_parallel_rank_restarts_its_group_and_its_requests_finish(tiny_model):
    async def run():
        engine = await AsyncLLM.start(_args(tiny_model, tensor_parallel_size=2))
        try:
            reference = await _run_all(engine, "ref")
            engine_pid = engine.engine_core_pid
            ranks = children_of(engine_pid)
            assert len(ranks) == 2, ranks
            moved = await _run_all(engine, "moved", kill=lambda: _kill(ranks[1]))
            _same(moved, reference)
            assert engine.recovery.num_restarts == 1 and engine.engine_core_pid != engine_pid
            assert len(children_of(engine.engine_core_pid)) == 2  # a whole new group
        finally:
            await engine.shutdown()

    asyncio.run(run())
