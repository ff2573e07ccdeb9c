"""The engine core in its own process: a busy loop between ZMQ sockets and ``EngineCore.step``.

Started by ``core_client.AsyncMPClient`` as ``python -m ember_server.engine.core_process``. It connects
a DEALER to the front end's ROUTER (requests in) and a PUSH to its PULL (outputs out), builds the
engine core, and says READY (or FAILED with the traceback) on the DEALER. Then, while requests
are unfinished, every pass drains the input socket and runs one step; when idle it blocks on the
input socket. A step that raises sends ``EngineCoreOutputs(error=...)`` and ends the process. The
process also ends when its parent is gone, so an engine is never orphaned.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from ember_scheduler.engine_types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from ember_server.engine import core_messages as msg
from ember_server.engine.core_sharing import CoreSharing, OtherProcessesCPU
from ember_server.engine.engine_args import EngineArgs
from ember_worker.logs import configure_started_process_logging

if TYPE_CHECKING:
    from ember_server.engine.lockstep import DataParallelPlace

_IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is alive


class EngineCoreProc:
    """Runs one engine core between the front end's sockets."""

    def __init__(
        self,
        engine_core,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        core_sharing: CoreSharing | None = None,
    ) -> None:
        self.engine_core = engine_core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.core_sharing = core_sharing
        self._encoder = msgspec.msgpack.Encoder()
        self._request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._ids_decoder = msgspec.msgpack.Decoder(list[str])

    def run(self, parent_pid: int) -> None:
        """Serve until SHUTDOWN or the parent's death; an exception in a step propagates."""
        core = self.engine_core
        while True:
            if os.getppid() != parent_pid:
                return
            if self.core_sharing is not None:
                self.core_sharing.poll()
            busy = core.has_unfinished_requests()
            if not busy and not self.input_socket.poll(_IDLE_POLL_MS):
                continue
            handled = self._drain_input()
            if handled is None:
                return
            if busy or handled:
                self._send(core.step())

    def _drain_input(self) -> bool | None:
        """Handle every waiting message; None on SHUTDOWN, else whether anything came."""
        handled = False
        while self.input_socket.poll(0):
            kind, payload = self.input_socket.recv_multipart(copy=False)
            kind = kind.bytes
            handled = True
            if kind == msg.ADD:
                self._add(payload.buffer)
            elif kind == msg.ABORT:
                self.engine_core.abort_requests(self._ids_decoder.decode(payload.buffer))
            elif kind == msg.SHUTDOWN:
                return None
            elif kind == msg.WAKE:
                pass  # only ends an idle wait (``lockstep``)
            else:
                raise RuntimeError(f"engine core got an unknown message kind {kind!r}")
        return handled

    def _add(self, buffer: memoryview) -> None:
        """Queue a request; any failure to decode or admit it is that request's error, answered
        as its ABORT with the reason; the engine and every other request go on."""
        try:
            request = self._request_decoder.decode(buffer)
            self.engine_core.add_request(request)
        except Exception as exc:
            self._reject(_request_id(buffer), f"{type(exc).__name__}: {exc}")

    def _reject(self, request_id: str, reason: str) -> None:
        output = EngineCoreOutput(
            request_id, [], finish_reason=FinishReason.ABORT, finish_detail=reason
        )
        self._send(EngineCoreOutputs(outputs=[output]))

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.output_socket.send(self._encoder.encode(outputs), copy=False)


def _request_id(buffer: memoryview) -> str:
    """The id (first field) of an ADD message, read without the typed decoder."""
    fields = msgspec.msgpack.decode(buffer)
    if not isinstance(fields, list) or not fields or not isinstance(fields[0], str):
        raise RuntimeError("engine core got an ADD message that is not an EngineCoreRequest")
    return fields[0]


def run_engine_core(
    args: EngineArgs,
    input_address: str,
    output_address: str,
    parent_pid: int,
    place: DataParallelPlace | None = None,
) -> int:
    """Connect, build the engine core, handshake and serve; returns the exit status. ``place``:
    this engine core's among lock-step data-parallel peers (``lockstep``)."""
    from ember_server.engine.engine_factory import make_engine_core
    from ember_server.engine.lockstep import LockstepEngineCoreProc, LockstepGroup
    from ember_server.engine.model_config import ModelConfig

    context = zmq.Context()
    input_socket = context.socket(zmq.DEALER)
    input_socket.setsockopt(zmq.RCVHWM, 0)  # never drop or stall a burst of requests
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    engine_core = None
    try:
        try:
            model_config = ModelConfig.from_engine_args(args)
            engine_core, model_config = make_engine_core(
                args, model_config, served=True, place=place
            )
            group = None if place is None else LockstepGroup(place, args.data_parallel_size)
        except Exception as exc:
            if engine_core is not None:  # the lock-step peers never met: stop the workers
                engine_core.shutdown()
            failed = msg.EngineCoreFailed(
                message=str(exc) or type(exc).__name__,
                bad_settings=isinstance(exc, ValueError),
                traceback=traceback.format_exc(),
            )
            input_socket.send_multipart([msg.FAILED, encoder.encode(failed)])
            return 1
        executor = engine_core.executor
        ready = msg.EngineCoreReady(
            pid=os.getpid(),
            num_kv_blocks=executor.num_kv_blocks,
            block_size=executor.block_size,
            max_model_len=model_config.max_model_len,
            max_num_kv_tokens=engine_core.max_num_tokens,
            prefix_caching_hash_algo=engine_core.kv_cache_manager.hasher.algo,
        )
        # The start-up heap (torch, transformers, the model: ~230k objects) never becomes
        # garbage: frozen, a full collection no longer scans it (a scan of that heap stalls a step).
        gc.collect()
        gc.freeze()
        input_socket.send_multipart([msg.READY, encoder.encode(ready)])
        step_threads = executor.step_threads  # None where the ranks run in other processes
        core_sharing = None
        # Sibling data-parallel engines have cores of their own: they are not others to yield to.
        if args.num_threads is None and args.data_parallel_size == 1 and step_threads is not None:
            core_sharing = CoreSharing(step_threads, OtherProcessesCPU((os.getpid(), parent_pid)))
        if group is None:
            proc = EngineCoreProc(engine_core, input_socket, output_socket, core_sharing)
        else:
            proc = LockstepEngineCoreProc(engine_core, input_socket, output_socket, group)
        try:
            proc.run(parent_pid)
        except Exception:
            error = traceback.format_exc()
            print(f"ember engine core failed:\n{error}", file=sys.stderr, flush=True)
            output_socket.send(encoder.encode(EngineCoreOutputs(error=error)))
            return 1
        finally:
            engine_core.shutdown()
            if group is not None:
                group.close()
        return 0
    finally:
        # Let queued outputs (an error report above all) reach the front end before closing.
        input_socket.close(linger=0)
        output_socket.close(linger=2000)
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Ember engine core process (started by the front end)."
    )
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--engine-args", required=True, help="EngineArgs as JSON.")
    parser.add_argument("--data-parallel-place", help="DataParallelPlace as JSON (lock-step).")
    options = parser.parse_args(argv)
    # Ctrl-C in a terminal, and SIGTERM from systemd, reach the whole process group: the front end
    # decides when we stop (after draining its requests), and we stop when it is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_started_process_logging()
    args = msgspec.json.decode(options.engine_args.encode(), type=EngineArgs)
    place = None
    if options.data_parallel_place:
        from ember_server.engine.lockstep import DataParallelPlace

        place = msgspec.json.decode(options.data_parallel_place.encode(), type=DataParallelPlace)
    return run_engine_core(
        args, options.input_address, options.output_address, options.parent_pid, place
    )


if __name__ == "__main__":
    sys.exit(main())
