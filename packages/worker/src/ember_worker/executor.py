"""The in-process executor: one worker in the engine core's own process."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ember_kv_cache import KVTransferConfig, TieredKVStore
from ember_scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from ember_spec_decode import SpeculativeConfig
from ember_worker.kv_cache import kv_cache_budget
from ember_worker.kv_connector import TieredConnectorWorker, layout_fingerprint
from ember_worker.model_loader import load_model
from ember_worker.model_runner import ModelRunner
from ember_worker.step_threads import StepThreads
from ember_worker.structured_outputs import XGrammarCompiler


class InProcessExecutor:
    """Implements ``ember_scheduler.Executor`` with one ``ModelRunner`` in this process.

    Loads the model, sizes the KV cache from ``kv_cache_memory`` bytes (required on the CPU; on
    a GPU, ``gpu_memory_utilization`` of the memory left free by the model when it is None) and
    reports the block count as ``num_kv_blocks``. ``grammar_compiler`` compiles structured-output
    specs with the ``tokenizer`` folder (default: ``model``); hand it to the engine core.
    ``num_threads`` sets torch's intra-op thread count: an int for every step, or a
    ``StepThreads`` (one count for large steps, another for small ones; kept as
    ``step_threads``, whose counts may be changed between steps); None leaves it alone. Several
    ranks run in the multiprocess or Ray executors (``executor_factory.make_executor``). With
    ``kv_transfer_config`` the runner moves KV chunks between its cache and the configured tiers
    (``kv_transfer_store``), keyed with
    ``prefix_caching_hash_algo``'s chain hashes (the scheduler's). ``execute_model(...,
    non_block=True)`` runs the step on one worker thread, steps in order (torch releases the GIL
    while it computes, so the engine core schedules meanwhile).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        tokenizer: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "auto",
        quantization: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        device: str | torch.device | None = None,
        num_threads: int | StepThreads | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        prefix_caching_hash_algo: str = "sha256",
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        step_threads = num_threads
        if num_threads is not None and not isinstance(num_threads, StepThreads):
            step_threads = StepThreads(num_threads)
        if step_threads is not None:
            torch.set_num_threads(step_threads.large)  # loading and warm-up
        self.step_threads = step_threads
        torch.manual_seed(seed)
        loaded = load_model(
            model,
            dtype=dtype,
            device=self.device,
            pack_weights=True,
            quantization=quantization,
        )
        limit = loaded.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        if not isinstance(max_model_len, int) or not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                f"got {max_model_len}"
            )
        self.loaded = loaded
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.grammar_compiler = XGrammarCompiler(
            model if tokenizer is None else tokenizer, loaded.config.vocab_size
        )
        self.model_runner = ModelRunner(
            loaded,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            device=self.device,
            grammar_compiler=self.grammar_compiler,
            speculative_config=speculative_config,
            step_threads=step_threads,
        )
        budget = kv_cache_budget(self.device, kv_cache_memory, gpu_memory_utilization)
        self._num_kv_blocks = self.model_runner.num_kv_blocks_for(budget)
        self.model_runner.initialize_kv_cache(self._num_kv_blocks)
        self._block_size = block_size
        self._step_thread: ThreadPoolExecutor | None = None
        self._kv_transfer_store = None
        if kv_transfer_config is not None:
            spec = self.model_runner.kv_cache_spec
            fingerprint = layout_fingerprint(
                loaded.path, spec, kv_transfer_config, prefix_caching_hash_algo, 0
            )
            self._kv_transfer_store = kv_transfer_config.make_store(fingerprint)
            self.model_runner.register_kv_connector(
                TieredConnectorWorker(self._kv_transfer_store, spec, kv_transfer_config.chunk_size)
            )

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    @property
    def kv_transfer_store(self) -> TieredKVStore | None:
        return self._kv_transfer_store

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self.model_runner is None:
            raise RuntimeError("InProcessExecutor.execute_model called after shutdown()")
        if not non_block:
            return self.model_runner.execute_model(scheduler_output)
        if self._step_thread is None:
            # One thread: steps run in the order given, and torch sees one caller.
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-step")
        return self._step_thread.submit(self.model_runner.execute_model, scheduler_output)

    def shutdown(self) -> None:
        """Release the KV cache and the model (the executor is unusable afterwards)."""
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True, cancel_futures=True)
            self._step_thread = None
        if self.model_runner is not None and self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()
        self.model_runner = None
        self.grammar_compiler.shutdown()
