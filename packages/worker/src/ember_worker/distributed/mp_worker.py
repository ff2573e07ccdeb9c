"""One rank of the multiprocess executor, as its own process (``python -m`` this module).

It joins the ``torch.distributed`` world, loads its part of the model and reports READY with the
KV blocks its budget holds (or FAILED with its traceback). Then it follows the executor's
broadcast: the KV block count to allocate, each step's ``SchedulerOutput`` (msgpack), a
structured-output spec to start compiling (a rank that samples compiles it in its compiler's
threads; the output rank reports the result on its own socket, ``grammar_proxy``), and STOP.
Only the output rank sends the step's ``ModelRunnerOutput`` back (every rank with a KV connector:
the executor combines their connector outputs). A step that raises sends FAILED
and ends the process; so does the executor's process going away (checked while idle).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future

import msgspec
import zmq

from ember_scheduler.outputs import SchedulerOutput
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_worker.distributed.grammar_proxy import compile_report
from ember_worker.distributed.groups import init_rank_groups
from ember_worker.distributed.worker import Worker, WorkerConfig, backend_for, rank_device
from ember_worker.logs import configure_started_process_logging

# Broadcast kinds (executor -> every rank): [kind, payload].
STEP, KV_BLOCKS, COMPILE, STOP = b"step", b"kv", b"grammar", b"stop"
# Result kinds (rank -> executor): [kind, rank, payload].
READY, FAILED, OUTPUT = b"ready", b"failed", b"output"

_IDLE_POLL_MS = 500  # how often an idle rank checks that the executor's process is alive


class ReadyReport(msgspec.Struct, array_like=True):
    """A started rank's KV block budget and, with a KV connector, its layout fingerprint's
    fields (the executor's scheduler-side lookups use the first rank's)."""

    num_blocks: int
    kv_fingerprint: dict | None = None


class WorkerProcConfig(msgspec.Struct, frozen=True):
    """How one worker process finds its executor and its peers."""

    worker: WorkerConfig
    rank: int
    init_method: str  # torch.distributed rendezvous, tcp://host:port
    broadcast_address: str
    result_address: str
    grammar_address: str  # the output rank's compile reports: [spec key, error or b""]
    parent_pid: int
    device: str | None = None


def run_worker(config: WorkerProcConfig) -> int:
    context = zmq.Context()
    commands = context.socket(zmq.SUB)
    commands.setsockopt(zmq.SUBSCRIBE, b"")
    commands.connect(config.broadcast_address)
    results = context.socket(zmq.PUSH)
    results.connect(config.result_address)
    rank = str(config.rank).encode()
    grammars = (
        GrammarReports(context, config)
        if config.rank == config.worker.parallel.output_rank
        else None
    )
    try:
        try:
            device = rank_device(config.rank, config.device)
            groups = init_rank_groups(
                config.worker.parallel, config.rank, config.init_method, backend_for(device)
            )
            worker = Worker(config.worker, groups, device)
            ready = ReadyReport(worker.num_available_blocks(), worker.kv_fingerprint_fields())
        except Exception:
            results.send_multipart([FAILED, rank, traceback.format_exc().encode()])
            return 1
        results.send_multipart([READY, rank, msgspec.msgpack.encode(ready)])
        return _serve(worker, config, commands, results, rank, grammars)
    finally:
        if grammars is not None:
            grammars.close()
        commands.close(linger=0)
        results.close(linger=2000)  # let a FAILED report reach the executor
        context.term()


def _serve(
    worker: Worker,
    config: WorkerProcConfig,
    commands: zmq.Socket,
    results: zmq.Socket,
    rank: bytes,
    grammars: GrammarReports | None,
) -> int:
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    encoder = msgspec.msgpack.Encoder()
    # With a KV connector every rank's loads and saves count: each one answers every step.
    answers = config.rank == config.worker.parallel.output_rank or worker.has_kv_connector
    while True:
        if not commands.poll(_IDLE_POLL_MS):
            if os.getppid() != config.parent_pid:
                return 0
            continue
        kind, payload = commands.recv_multipart(copy=False)
        kind = kind.bytes
        try:
            if kind == STEP:
                output = worker.execute_model(decoder.decode(payload.buffer))
                if answers:
                    results.send_multipart([OUTPUT, rank, encoder.encode(output)], copy=False)
            elif kind == COMPILE:
                key = payload.bytes
                if worker.grammar_compiler is not None:  # a rank that samples
                    spec = msgspec.msgpack.decode(key, type=StructuredOutputsParams)
                    future = worker.grammar_compiler.compile(spec)
                    if grammars is not None:
                        future.add_done_callback(lambda done, key=key: grammars.report(key, done))
            elif kind == KV_BLOCKS:
                worker.initialize_kv_cache(int(payload.bytes))
            elif kind == STOP:
                worker.shutdown()
                return 0
            else:
                raise RuntimeError(f"worker got an unknown command {kind!r}")
        except Exception:
            results.send_multipart([FAILED, rank, traceback.format_exc().encode()])
            return 1


class GrammarReports:
    """The output rank's compile reports, sent from its compiler's threads (hence the lock)."""

    def __init__(self, context: zmq.Context, config: WorkerProcConfig) -> None:
        self._lock = threading.Lock()
        self._socket = context.socket(zmq.PUSH)
        self._socket.connect(config.grammar_address)

    def report(self, key: bytes, future: Future) -> None:
        error = compile_report(future)
        with self._lock:
            if self._socket is not None:
                self._socket.send_multipart([key, (error or "").encode()])

    def close(self) -> None:
        with self._lock:
            self._socket.close(linger=0)
            self._socket = None


def exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as its parent is gone, watched from a thread of its own: a rank
    waiting at the rendezvous or in a collective cannot check (the ranks of other data-parallel
    replicas that never arrive would hold it there until the timeout)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_IDLE_POLL_MS / 1000)
        os._exit(0)

    threading.Thread(target=watch, name="ember-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Ember worker rank (started by the executor).")
    parser.add_argument("--config", required=True, help="WorkerProcConfig as JSON.")
    options = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group; the executor decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_started_process_logging()
    config = msgspec.json.decode(options.config.encode(), type=WorkerProcConfig)
    exit_with_parent(config.parent_pid)
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main())
