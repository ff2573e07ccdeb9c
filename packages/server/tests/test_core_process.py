"""The engine core process: start-up handshake failures and death detection."""

import asyncio
import os
import signal

import pytest

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.core_client import ENGINE_OMP_ENV, EngineDeadError, EngineStartupError
from ember_server.engine.engine_args import EngineArgs


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return str(tiny_model("llama"))


def test_killed_engine_fails_in_flight_requests_at_once(model_path):
    async def run():
        args = EngineArgs(
            model=model_path,
            dtype="float32",
            kv_cache_memory=8 * 1024**2,
            max_model_len=512,
            max_engine_restarts=0,
        )
        engine = await AsyncLLM.start(args)
        try:
            params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            streams = [engine.generate("def foo(", params, f"r{i}") for i in range(3)]
            seen = []

            async def consume(stream):
                async for out in stream:
                    seen.append(out)

            tasks = [asyncio.ensure_future(consume(s)) for s in streams]
            while not seen:
                await asyncio.sleep(0.01)
            os.kill(engine.engine_core_pid, signal.SIGKILL)
            # Every in-flight request fails with EngineDeadError, well before it could finish.
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=10
            )
            assert all(isinstance(r, EngineDeadError) for r in results)
            assert engine.errored and not engine.is_healthy()
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                engine.generate("def foo(", params, "after")
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_engine_that_cannot_start_reports_why(model_path):
    args = EngineArgs(model=model_path, dtype="float32", kv_cache_memory=1)
    with pytest.raises(EngineStartupError, match="kv_cache_memory"):
        asyncio.run(AsyncLLM.start(args))


def test_bad_model_folder_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="model"):
        asyncio.run(AsyncLLM.start(EngineArgs(model=str(tmp_path), dtype="float32")))


def test_a_refused_request_fails_alone_and_a_failing_loop_reports_its_error(model_path):
    async def run():
        args = EngineArgs(
            model=model_path, dtype="float32", kv_cache_memory=4 * 1024**2, max_engine_restarts=0
        )
        engine = await AsyncLLM.start(args)
        try:
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            (client,) = engine.clients  # one engine core
            stream = engine.generate("def foo(", params, "victim")
            await anext(stream)
            # Past the front end's checks, straight to the engine: a token id the model lacks is
            # refused when admitted (it used to fail the worker's step, and so every request).
            bad = EngineCoreRequest("bad", [1, 10**7], SamplingParams(max_tokens=1))
            await client.add_requests([bad])
            received = 0
            while received < 50:
                received += len((await anext(stream)).outputs[0].token_ids)
            assert not engine.errored and client.is_alive()
            # A message the engine core cannot read (abort ids that are not strings: a front-end
            # bug) ends its loop: the error is reported and every request fails.
            await client.abort_requests([1])
            with pytest.raises(EngineDeadError, match="engine core failed"):
                async for _ in stream:
                    pass
            assert engine.errored
            await asyncio.wait_for(_until(lambda: not client.is_alive()), timeout=10)
            assert client.exit_code == 1
        finally:
            await engine.shutdown()

    asyncio.run(run())


async def _until(predicate):
    while not predicate():
        await asyncio.sleep(0.02)


PARENT_SCRIPT = """
import asyncio, sys
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.engine_args import EngineArgs

async def main():
    engine = await AsyncLLM.start(EngineArgs(model=sys.argv[1], kv_cache_memory=1 << 20))
    print(engine.engine_core_pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.slow
def test_engine_process_exits_when_its_front_end_is_killed(model_path):
    import subprocess
    import sys
    import time

    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, model_path], stdout=subprocess.PIPE, text=True
    )
    try:
        engine_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(engine_pid, signal.SIGKILL)
        pytest.fail("the engine core process outlived its front end")
    finally:
        parent.kill()


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        pairs = [entry.split(b"=", 1) for entry in environ.read().split(b"\0") if b"=" in entry]
    return {key.decode(): value.decode() for key, value in pairs}


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads Linux's /proc")
@pytest.mark.parametrize("user_setting", [None, ("OMP_WAIT_POLICY", "PASSIVE")])
def test_engine_threads_spin_briefly_at_barriers_unless_the_user_says_otherwise(
    model_path, monkeypatch, user_setting
):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    if user_setting is not None:
        monkeypatch.setenv(*user_setting)

    async def engine_environ():
        args = EngineArgs(
            model=model_path, dtype="float32", kv_cache_memory=8 * 1024**2, max_model_len=64
        )
        engine = await AsyncLLM.start(args)
        try:
            return _environ(engine.engine_core_pid)
        finally:
            await engine.shutdown()

    environ = asyncio.run(engine_environ())
    if user_setting is None:
        assert {k: environ.get(k) for k in ENGINE_OMP_ENV} == ENGINE_OMP_ENV
    else:
        assert environ[user_setting[0]] == user_setting[1]
        assert "GOMP_SPINCOUNT" not in environ
