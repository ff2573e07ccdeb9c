"""A real ``ember serve`` (app + engine core process) run in a background thread, for the tests.

The server binds 127.0.0.1 on a free port and is always shut down, engine process included.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import uvicorn

from ember_server.cli.event_loop import run_event_loop
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.engine_args import EngineArgs
from ember_server.openai.api_server import build_app
from ember_server.openai.listener import bind_socket


class ServerThread:
    """Context manager: ``with ServerThread(args) as server: server.base_url ...``."""

    def __init__(
        self,
        engine_args: EngineArgs,
        api_key: str | None = None,
        tool_call_parser: str | None = None,
        max_body_size: int | None = None,
        lora_modules: dict[str, str] | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine_args = engine_args
        self.lora_modules = lora_modules
        self.api_key = api_key
        self.tool_call_parser = tool_call_parser
        self.max_body_size = max_body_size
        self.reasoning_parser = reasoning_parser
        self.engine: AsyncLLM | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ember-test-server", daemon=True)
        self._socket = bind_socket("127.0.0.1", 0)
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        try:
            run_event_loop(self._main())  # as `ember serve` runs
        except BaseException as exc:  # reported to the test thread by __enter__
            self._error = exc

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.engine = await AsyncLLM.start(self.engine_args)
        try:
            app = build_app(
                self.engine,
                self.api_key,
                self.tool_call_parser,
                self.max_body_size,
                lora_modules=self.lora_modules,
                reasoning_parser=self.reasoning_parser,
            )
            config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
            self._server = uvicorn.Server(config)
            await self._server.serve(sockets=[self._socket])
        finally:
            await self.engine.shutdown()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 300
        while not (self._server is not None and self._server.started):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"test server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("test server did not start in 300 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=60)
        self._socket.close()

    def call(self, coro, timeout: float = 30):
        """Run ``coro`` on the server's event loop (e.g. to ask the engine something)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_for_metric(self, name: str, condition, timeout: float = 60.0) -> float:
        """Poll ``/metrics`` until ``condition(value)`` holds; the value."""
        deadline = time.monotonic() + timeout
        while not condition(value := self.metric(name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} stayed at {value} for {timeout} s")
            time.sleep(0.05)
        return value

    def metric(self, name: str) -> float:
        """The value of one ``ember:`` gauge or counter from ``/metrics``."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        if match is None:
            raise KeyError(f"{name} not in /metrics")
        return float(match.group(1))
