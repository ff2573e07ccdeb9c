"""The multiprocess executor: one worker process per rank on this machine, as vLLM v1's.

Each step's ``SchedulerOutput`` is msgpack-encoded once and broadcast to every rank over a ZMQ
XPUB socket; only the output rank (the last pipeline stage's first tensor-parallel rank) answers
on the PULL socket (every rank with a KV connector; their connector outputs are combined). The executor watches its processes: a rank that fails or dies, at start-up or
in a step, raises a ``RuntimeError`` naming the rank, which the engine core turns into its death
(every other rank is then stopped by ``shutdown``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque

import msgspec
import torch
import zmq

from ember_kv_cache import TieredKVStore
from ember_scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from ember_worker.distributed import mp_worker as proto
from ember_worker.distributed.grammar_proxy import RankGrammarCompiler
from ember_worker.distributed.mp_worker import WorkerProcConfig
from ember_worker.distributed.ports import free_port
from ember_worker.distributed.worker import (
    RankAnswers,
    WorkerConfig,
    WorkerFailedError,
    model_vocab_size,
    scheduler_side_store,
)
from ember_worker.kv_specs import model_layer_kv_specs

_POLL_MS = 50  # how often a waiting executor checks that its workers are alive
_STOP_GRACE_S = 5.0
_DEATH_NOTICE_S = 0.5  # how long a failed step waits to see whether a rank died


class MultiprocExecutor:
    """Implements the engine core's ``Executor`` with one process per rank."""

    def __init__(
        self, config: WorkerConfig, device: str | None = None, startup_timeout: float = 600.0
    ) -> None:
        parallel = config.parallel
        if torch.cuda.is_available() and device is None:
            count = torch.cuda.device_count()
            if parallel.world_size > count:
                raise ValueError(
                    f"{parallel.world_size} ranks (tensor x pipeline parallel) need as many GPUs; "
                    f"this machine has {count} (the ray backend spans several machines)"
                )
        self.config = config
        self.block_size = config.block_size
        self.step_threads = None  # the ranks set their own threads, in their processes
        self.kv_transfer_store: TieredKVStore | None = None  # the scheduler side's lookups
        self._world_size = parallel.world_size
        self._answers = RankAnswers(config)
        self._received: dict[int, deque[ModelRunnerOutput]] = {
            rank: deque() for rank in self._answers.ranks
        }
        self._socket_dir = tempfile.mkdtemp(prefix="ember-workers-")
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.XPUB)
        self._commands.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.bind(f"ipc://{self._socket_dir}/commands")
        self._results = self._context.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, 0)
        self._results.bind(f"ipc://{self._socket_dir}/results")
        # The output rank's grammar compile reports, read on their own thread: the scheduler
        # waits for them between steps, while no step output is being received.
        self.grammar_compiler = RankGrammarCompiler(self._send_compile)
        grammar_reports = self._context.socket(zmq.PULL)
        grammar_reports.bind(f"ipc://{self._socket_dir}/grammars")
        self._stopping = threading.Event()
        self._grammar_thread = threading.Thread(
            target=self._read_grammar_reports, args=(grammar_reports,), daemon=True
        )
        self._grammar_thread.start()
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self.processes: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop, self.processes, 0.0)
        self._failed = False
        self._in_flight: deque[StepOutput] = deque()  # steps sent, outputs not received
        self.num_steps_sent = 0  # data-parallel lock-step counts its steps by it
        self.vocab_size = model_vocab_size(config.model)
        self.kv_cache_specs = model_layer_kv_specs(config.model)
        try:
            self.num_kv_blocks = self._start(config, device, startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _start(self, config: WorkerConfig, device: str | None, timeout: float) -> int:
        # Data-parallel replicas sharing one expert-parallel world meet at their own address.
        init_method = config.parallel.data_parallel_init_method or (
            f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        )
        for rank in range(self._world_size):
            proc_config = WorkerProcConfig(
                worker=config,
                rank=rank,
                init_method=init_method,
                broadcast_address=f"ipc://{self._socket_dir}/commands",
                result_address=f"ipc://{self._socket_dir}/results",
                grammar_address=f"ipc://{self._socket_dir}/grammars",
                parent_pid=os.getpid(),
                device=device,
            )
            argv = ["--config", msgspec.json.encode(proc_config).decode()]
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ember_worker.distributed.mp_worker", *argv]
                )
            )
        reports: dict[int, proto.ReadyReport] = {}
        subscribed = 0
        deadline = time.monotonic() + timeout
        while len(reports) < self._world_size or subscribed < self._world_size:
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"worker ranks did not start within {timeout:.0f} s")
            while self._commands.poll(0):
                subscribed += self._commands.recv()[:1] == b"\x01"
            if not self._results.poll(_POLL_MS):
                self._check_alive("during start-up")
                continue
            kind, rank, payload = self._results.recv_multipart()
            if kind == proto.READY:
                reports[int(rank)] = msgspec.msgpack.decode(payload, type=proto.ReadyReport)
            else:
                self._raise_failed(kind, rank, payload, "at start-up")
        # Every rank allocates the block count that fits the smallest budget.
        num_blocks = min(report.num_blocks for report in reports.values())
        self.kv_transfer_store = scheduler_side_store(config, reports[0].kv_fingerprint)
        self._commands.send_multipart([proto.KV_BLOCKS, str(num_blocks).encode()])
        return num_blocks

    def _send_compile(self, key: bytes) -> None:
        if not self._failed and self.processes:
            self._commands.send_multipart([proto.COMPILE, key])

    def _read_grammar_reports(self, socket: zmq.Socket) -> None:
        try:
            while not self._stopping.is_set():
                if socket.poll(_POLL_MS):
                    key, error = socket.recv_multipart()
                    self.grammar_compiler.resolve(key, error.decode() or None)
        finally:
            socket.close(linger=0)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | StepOutput:
        """Send a step to the workers; with ``non_block`` return before its output comes
        (``StepOutput.result()`` receives it; the workers run steps in the order sent)."""
        if self._failed or not self.processes:
            raise WorkerFailedError("the executor's workers have failed or been shut down")
        self._commands.send_multipart([proto.STEP, self._encoder.encode(scheduler_output)])
        self.num_steps_sent += 1
        step = StepOutput(self)
        self._in_flight.append(step)
        return step if non_block else step.result()

    def _receive_output(self) -> None:
        """Receive the output of the oldest step in flight (from every answering rank: each
        sends its steps in order, but the ranks' messages interleave)."""
        while not all(self._received.values()):
            while not self._results.poll(_POLL_MS):
                self._check_alive("in a step")
            kind, rank, payload = self._results.recv_multipart(copy=False)
            if kind.bytes != proto.OUTPUT:
                self._raise_failed(kind.bytes, rank.bytes, payload.bytes, "in a step")
            output = self._output_decoder.decode(payload.buffer)
            self._received[int(rank.bytes)].append(output)
        outputs = [self._received[rank].popleft() for rank in self._answers.ranks]
        self._in_flight.popleft().output = self._answers.merge(outputs)

    def _check_alive(self, when: str, reported: set[int] | None = None) -> None:
        """WorkerFailedError naming a rank that exited, unless it is in ``reported`` (ranks that
        reported their own failure: their exit follows it) or its report is waiting."""
        for rank, process in enumerate(self.processes):
            code = process.poll()
            if code is None or (reported is not None and rank in reported):
                continue
            if reported is not None:
                self._note_reports(reported, _POLL_MS)  # its report may still be on its way
                if rank in reported:
                    continue
            self._failed = True
            raise WorkerFailedError(
                f"worker rank {rank} (pid {process.pid}) exited with code {code} {when}"
            )

    def _note_reports(self, reported: set[int], wait_ms: int = 0) -> None:
        """Add to ``reported`` the ranks whose failure reports are waiting on the results."""
        while self._results.poll(wait_ms):
            kind, rank, _ = self._results.recv_multipart()
            if kind not in (proto.OUTPUT, proto.READY):
                reported.add(int(rank))
            wait_ms = 0

    def _raise_failed(self, kind: bytes, rank: bytes, payload: bytes, when: str) -> None:
        self._failed = True
        # A rank whose peer died fails in its collective; report the dead peer, the cause.
        reported = {int(rank)}
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while time.monotonic() < deadline:
            self._note_reports(reported)
            self._check_alive(when, reported)
            time.sleep(_POLL_MS / 1000)
        detail = payload.decode(errors="replace").rstrip()
        last = detail.splitlines()[-1] if detail else kind.decode(errors="replace")
        raise WorkerFailedError(f"worker rank {int(rank)} failed {when}: {last}\n{detail}")

    def shutdown(self) -> None:
        """Stop every worker process (at once after a failure) and release the sockets."""
        if self.processes and not self._failed:
            with contextlib.suppress(zmq.ZMQError):
                self._commands.send_multipart([proto.STOP, b""])
        _stop(self.processes, 0.0 if self._failed else _STOP_GRACE_S)
        self._finalizer.detach()
        self._stopping.set()
        self._grammar_thread.join()
        self.grammar_compiler.shutdown()
        self._commands.close(linger=0)
        self._results.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self.kv_transfer_store is not None:
            self.kv_transfer_store.close()


class StepOutput:
    """The output of a step sent to the worker processes, received when first asked for
    (after the outputs of the steps sent before it: they come back in order)."""

    __slots__ = ("_executor", "output")

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        while self.output is None:
            self._executor._receive_output()
        return self.output


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the processes to exit, then kill the rest and reap them all."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
    processes.clear()
