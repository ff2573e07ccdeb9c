"""The in-process executor: one ``Worker`` in the engine core's own process, plus its step thread."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ember_kv_cache import KVTransferConfig, TieredKVStore
from ember_scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from ember_worker.distributed.worker import Worker, WorkerConfig
from ember_worker.kv_specs import layer_kv_specs
from ember_worker.step_threads import StepThreads


class InProcessExecutor:
    """Implements ``ember_scheduler.Executor`` with one ``Worker`` in this process.

    Built from a ``WorkerConfig``, or from a model folder and ``WorkerConfig``'s fields, where
    ``num_threads`` may also be a ``StepThreads`` and ``kv_transfer_config`` a
    ``KVTransferConfig``. ``execute_model(..., non_block=True)`` runs the step on one worker
    thread, steps in order (torch releases the GIL while it computes, so the engine core
    schedules meanwhile). ``step_threads`` is the worker's: its counts may change between steps.
    """

    def __init__(
        self,
        model: str | os.PathLike | WorkerConfig,
        *,
        device: str | torch.device | None = None,
        num_threads: int | StepThreads | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        **settings,
    ) -> None:
        if isinstance(model, WorkerConfig):
            if settings or num_threads is not None or kv_transfer_config is not None:
                raise ValueError("InProcessExecutor takes a WorkerConfig or settings, not both")
            config = model
        else:
            if isinstance(num_threads, StepThreads):
                settings.update(
                    small_num_threads=num_threads.small,
                    large_step_min_tokens=num_threads.large_min_tokens,
                )
                num_threads = num_threads.large
            if kv_transfer_config is not None:
                settings["kv_transfer"] = kv_transfer_config.as_dict()
            config = WorkerConfig(str(model), num_threads=num_threads, **settings)
        if config.parallel.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor x pipeline parallel "
                f"size is {config.parallel.world_size} (use 'mp' or 'ray')"
            )
        self.worker: Worker | None = Worker(config, device=device)
        self.num_kv_blocks = self.worker.num_available_blocks()
        self.worker.initialize_kv_cache(self.num_kv_blocks)
        self.block_size = config.block_size
        self.kv_cache_specs = layer_kv_specs(self.worker.loaded.config)
        self.vocab_size = self.worker.vocab_size
        self.kv_transfer_store: TieredKVStore | None = self.worker.kv_transfer_store
        self.grammar_compiler = self.worker.grammar_compiler
        self.step_threads = self.worker.step_threads
        self.model_runner = self.worker.model_runner
        self.loaded = self.worker.loaded
        self.device = self.worker.device
        self.max_model_len = self.worker.max_model_len
        self._step_thread: ThreadPoolExecutor | None = None

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self.worker is None:
            raise RuntimeError("InProcessExecutor.execute_model called after shutdown()")
        if not non_block:
            return self.worker.execute_model(scheduler_output)
        if self._step_thread is None:
            # One thread: steps run in the order given, and torch sees one caller.
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-step")
        return self._step_thread.submit(self.worker.execute_model, scheduler_output)

    def shutdown(self) -> None:
        """Release the KV cache and the model (the executor is unusable afterwards)."""
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True, cancel_futures=True)
            self._step_thread = None
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = self.model_runner = self.loaded = None
