"""Data-parallel attention with expert parallelism: engine cores that step in lock-step.

With ``--data-parallel-size N --enable-expert-parallel`` the N engine cores' worker ranks form one
expert-parallel group (``ember_worker.distributed.groups``): every MoE layer of a forward is an
all-to-all over every replica's ranks. So whenever one engine core runs a forward, every engine
core must run one, in the same order. The rule kept here: each pass of an engine core's loop, the
engine cores agree (an all-reduce of a has-work flag over a gloo group of the engine core
processes) whether any of them has work, and if so every one of them sends its executor exactly
one step. An engine core without requests (or whose scheduler ran nothing) sends an empty step,
on which its workers run only the MoE layers' collectives (``models.moe.idle_expert_pass``),
serving their experts to the others' tokens. When none has work they all go idle together and
block on their input sockets as a lone engine does; the front end wakes every engine core when it
sends one a request (``core_client``), so a sleeping peer does not delay it. A SHUTDOWN to any
engine core stops them all at the same pass.

The launcher (``core_client.launch_engines``) gives each engine core its ``DataParallelPlace``.
"""

from __future__ import annotations

import datetime
import os

import msgspec

from ember_scheduler.outputs import CachedRequestData, SchedulerOutput
from ember_server.engine.core_process import _IDLE_POLL_MS, EngineCoreProc
from ember_worker.distributed.ports import free_port

# How long an engine core waits in the agreement for a peer that is alive but stuck.
LOCKSTEP_TIMEOUT_S = 600.0


class DataParallelPlace(msgspec.Struct, frozen=True):
    """One engine core's place among replicas sharing an expert-parallel group: its rank, where
    the engine cores meet for their lock-step agreement and where their workers meet."""

    rank: int
    engines_init_method: str  # tcp://host:port
    workers_init_method: str


def spans_engines(args) -> bool:
    """Whether ``args`` (``EngineArgs``) make the engine cores one expert-parallel group."""
    return args.data_parallel_size > 1 and args.enable_expert_parallel


def data_parallel_places(size: int, host: str = "127.0.0.1") -> list[DataParallelPlace]:
    """Each of ``size`` engine cores' place on this machine, with fresh rendezvous ports."""
    engines = f"tcp://{host}:{free_port(host)}"
    workers = f"tcp://{host}:{free_port(host)}"
    return [DataParallelPlace(rank, engines, workers) for rank in range(size)]


class LockstepGroup:
    """The engine cores' agreement, over a gloo group of their processes."""

    def __init__(self, place: DataParallelPlace, size: int) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=place.engines_init_method,
            world_size=size,
            rank=place.rank,
            timeout=datetime.timedelta(seconds=LOCKSTEP_TIMEOUT_S),
        )

    def agree(self, has_work: bool, stop: bool) -> tuple[bool, bool]:
        """(whether any engine core has work, whether any was told to stop)."""
        import torch
        import torch.distributed as dist

        flags = torch.tensor([int(has_work), int(stop)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def empty_step() -> SchedulerOutput:
    """A step that schedules nothing (its workers run only the collectives)."""
    return SchedulerOutput([], CachedRequestData(), {}, 0)


class LockstepEngineCoreProc(EngineCoreProc):
    """``EngineCoreProc`` whose every pass is agreed with its data-parallel peers (module doc)."""

    def __init__(self, engine_core, input_socket, output_socket, group: LockstepGroup) -> None:
        super().__init__(engine_core, input_socket, output_socket)
        self.group = group

    def run(self, parent_pid: int) -> None:
        core = self.engine_core
        executor = core.executor
        while True:
            if os.getppid() != parent_pid:
                return  # the peers fail in their next agreement and end too
            if not self._has_work():
                self.input_socket.poll(_IDLE_POLL_MS)
            handled = self._drain_input()
            any_work, stop = self.group.agree(self._has_work(), handled is None)
            if stop:
                return
            if not any_work:
                if handled:
                    self._send(core.step())  # rejections and aborts; runs no step when idle
                continue
            steps_before = executor.num_steps_sent
            if self._has_work():
                self._send(core.step())
            if executor.num_steps_sent == steps_before:
                executor.execute_model(empty_step())

    def _has_work(self) -> bool:
        core = self.engine_core
        return core.has_unfinished_requests() or core.scheduler.has_kv_transfers()
