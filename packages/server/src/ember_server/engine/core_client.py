"""The front end's side of the engine core process: spawn, handshake, send, receive, watch.

``AsyncMPClient.launch`` binds a ROUTER (requests out) and a PULL (outputs in) on IPC sockets in a
private temp folder and starts ``python -m ember_server.engine.core_process``; ``wait_ready`` waits for
its READY (or FAILED, or its exit). A thread waits on the process; the moment it exits the client
calls ``on_engine_dead`` in the event loop, so nobody waits on a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from ember_scheduler.engine_types import EngineCoreOutputs, EngineCoreRequest
from ember_server.engine import core_messages as msg
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.lockstep import DataParallelPlace, data_parallel_places, spans_engines

logger = logging.getLogger(__name__)

# OpenMP threads of the engine process spin about 0.1 ms at a barrier (libgomp counts about
# 100,000 spins per ms), then sleep. Long enough to carry a step from one parallel region to the
# next without a wake-up; short enough to give the core back to the front end between steps
# (libgomp's default spins about 3 ms; the passive policy, not at all).
ENGINE_OMP_ENV = {"GOMP_SPINCOUNT": "10000"}


class EngineDeadError(RuntimeError):
    """The engine core process is gone (crashed, killed, or failed a step)."""


class EngineStartupError(RuntimeError):
    """The engine core process could not build the engine or never said it was ready.

    ``bad_settings`` is true when the engine refused the settings (a ValueError there: the
    KV cache memory holds no block, max_model_len does not fit, ...); ``engine_traceback`` is
    the engine core's traceback, when it sent one.
    """

    def __init__(self, message: str, bad_settings: bool = False, engine_traceback: str = ""):
        super().__init__(message)
        self.bad_settings = bad_settings
        self.engine_traceback = engine_traceback


class AsyncMPClient:
    """Talks to one engine core process from an asyncio event loop."""

    def __init__(self) -> None:
        self._context = zmq.asyncio.Context()
        self._socket_dir = tempfile.mkdtemp(prefix="ember-engine-")
        self.input_address = f"ipc://{self._socket_dir}/input"
        self.output_address = f"ipc://{self._socket_dir}/output"
        # No high-water marks: a ROUTER over its limit drops messages silently, and a burst of
        # requests (or outputs) must never be lost.
        self._input_socket = self._context.socket(zmq.ROUTER)
        self._input_socket.setsockopt(zmq.LINGER, 0)
        self._input_socket.setsockopt(zmq.SNDHWM, 0)
        self._input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input_socket.bind(self.input_address)
        self._output_socket = self._context.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.LINGER, 0)
        self._output_socket.setsockopt(zmq.RCVHWM, 0)
        self._output_socket.bind(self.output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._engine_identity: bytes | None = None
        self.process: subprocess.Popen | None = None
        self.ready: msg.EngineCoreReady | None = None
        self.exit_code: int | None = None
        self._exited: asyncio.Future | None = None
        self._on_engine_dead: Callable[[int], None] | None = None
        self._shutting_down = False
        self._launched_at = 0.0
        self._closed = False
        self.lockstep_peers: list[AsyncMPClient] = []  # engine cores stepping with this one

    @classmethod
    def launch(cls, args: EngineArgs, place: DataParallelPlace | None = None) -> AsyncMPClient:
        """Bind the sockets and start the engine core process, without waiting for it (no event
        loop needed); ``wait_ready`` then waits for its handshake. ``place``: its place among
        lock-step data-parallel engine cores (``lockstep``)."""
        client = cls()
        try:
            command = [
                sys.executable, "-m", "ember_server.engine.core_process",
                "--input-address", client.input_address,
                "--output-address", client.output_address,
                "--parent-pid", str(os.getpid()),
                "--engine-args", msgspec.json.encode(args).decode(),
            ]  # fmt: skip
            if place is not None:
                command += ["--data-parallel-place", msgspec.json.encode(place).decode()]
            # A user's own OpenMP waiting settings win (see engine_factory.default_step_threads).
            env = dict(os.environ)
            if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & env.keys():
                env.update(ENGINE_OMP_ENV)
            client._launched_at = time.monotonic()
            client.process = subprocess.Popen(command, env=env)
        except BaseException:
            client._close()
            raise
        logger.info(
            "starting the engine core process (pid %d) for %s", client.process.pid, args.model
        )
        return client

    async def wait_ready(
        self, on_engine_dead: Callable[[int], None], startup_timeout: float = 600.0
    ) -> None:
        """Wait for the launched engine's handshake; on any failure (or cancellation) the
        process is stopped and the sockets closed."""
        try:
            await self._handshake(on_engine_dead, startup_timeout)
        except BaseException:
            await asyncio.to_thread(self.abandon)
            raise

    async def _handshake(self, on_engine_dead, startup_timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        threading.Thread(
            target=self._wait_for_exit, args=(loop,), name="ember-engine-watch", daemon=True
        ).start()
        handshake = asyncio.ensure_future(self._input_socket.recv_multipart())
        try:
            done, _ = await asyncio.wait(
                {handshake, self._exited},
                timeout=startup_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            if not handshake.done():
                handshake.cancel()
        if handshake not in done:
            if self._exited in done:
                raise EngineStartupError(
                    f"engine core process exited with code {self.exit_code} during start-up"
                )
            raise EngineStartupError(f"engine core not ready after {startup_timeout:.0f} s")
        identity, kind, payload = handshake.result()
        if kind == msg.FAILED:
            failed = msgspec.msgpack.decode(payload, type=msg.EngineCoreFailed)
            logger.debug("engine core start-up traceback:\n%s", failed.traceback)
            raise EngineStartupError(
                f"engine core failed to start: {failed.message}",
                bad_settings=failed.bad_settings,
                engine_traceback=failed.traceback,
            )
        if kind != msg.READY:
            raise EngineStartupError(f"engine core sent {kind!r} instead of READY")
        self._engine_identity = identity
        self.ready = msgspec.msgpack.decode(payload, type=msg.EngineCoreReady)
        logger.info(
            "engine core ready in %.1f s: %d KV blocks of %d tokens, max_model_len %d",
            time.monotonic() - self._launched_at,
            self.ready.num_kv_blocks,
            self.ready.block_size,
            self.ready.max_model_len,
        )
        self._on_engine_dead = on_engine_dead
        if self._exited.done():  # died right after saying READY
            on_engine_dead(self.exit_code)

    def _wait_for_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        code = self.process.wait()
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            loop.call_soon_threadsafe(self._process_exited, code)

    def _process_exited(self, code: int) -> None:
        self.exit_code = code
        if not self._exited.done():
            self._exited.set_result(code)
        if self._on_engine_dead is not None and not self._shutting_down:
            self._on_engine_dead(code)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def is_alive(self) -> bool:
        return self.process is not None and self.exit_code is None and self.process.poll() is None

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            await self._send(msg.ADD, self._encoder.encode(request))
        for peer in self.lockstep_peers:  # they step with this engine: end their idle waits
            with contextlib.suppress(EngineDeadError):
                await peer._send(msg.WAKE, b"")

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(msg.ABORT, self._encoder.encode(request_ids))

    async def _send(self, kind: bytes, payload: bytes) -> None:
        if not self.is_alive():
            raise EngineDeadError(f"engine core process is gone (exit code {self.exit_code})")
        try:
            await self._input_socket.send_multipart(
                [self._engine_identity, kind, payload], copy=False
            )
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the engine's socket is gone
            raise EngineDeadError(f"engine core process is unreachable: {exc}") from exc

    async def get_output(self) -> EngineCoreOutputs:
        frame = await self._output_socket.recv(copy=False)
        return self._outputs_decoder.decode(frame.buffer)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine to stop, give it ``timeout`` seconds, then terminate it; close sockets."""
        self._shutting_down = True
        if self._engine_identity is not None and self.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._input_socket.send_multipart([self._engine_identity, msg.SHUTDOWN, b""])
        await asyncio.to_thread(self._stop_process, timeout)
        self._close()

    def _stop_process(self, grace: float) -> None:
        """Wait ``grace`` seconds for the process to exit, then kill it (it ignores SIGTERM)."""
        process = self.process
        if process is None:
            return
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def abandon(self) -> None:
        """Stop the engine at once and close (a start-up that failed or was stopped)."""
        self._shutting_down = True
        self._stop_process(0.0)
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._context.destroy(linger=0)
            shutil.rmtree(self._socket_dir, ignore_errors=True)


def launch_engines(args: EngineArgs) -> list[AsyncMPClient]:
    """Start ``args.data_parallel_size`` engine core processes without waiting for them (for
    ``AsyncLLM.start(args, clients=...)``); if one cannot start, those already started stop."""
    clients: list[AsyncMPClient] = []
    places = data_parallel_places(args.data_parallel_size) if spans_engines(args) else None
    try:
        for rank in range(args.data_parallel_size):
            clients.append(AsyncMPClient.launch(args, None if places is None else places[rank]))
    except BaseException:
        for client in clients:
            client.abandon()
        raise
    if places is not None:
        for client in clients:
            client.lockstep_peers = [peer for peer in clients if peer is not client]
    return clients
