"""Building the engine core (scheduler + in-process executor) from ``EngineArgs``."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_server.engine_args import EngineArgs
from ember_server.model_config import ModelConfig

if TYPE_CHECKING:
    from ember_worker.step_threads import StepThreads

logger = logging.getLogger(__name__)

# KV cache budget when none is given and the model runs on the CPU (the worker sizes GPU caches
# from free memory itself).
DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 1024**2

# Served steps of at least this many scheduled tokens take every core whatever other processes
# do (see default_step_threads).
SERVED_LARGE_STEP_TOKENS = 32


def default_step_threads(*, served: bool, data_parallel_size: int = 1) -> StepThreads:
    """torch's intra-op threads per step when ``EngineArgs.num_threads`` is None: every core this
    process may run on, for every step. ``served`` (``ember serve``): steps of fewer than
    ``SERVED_LARGE_STEP_TOKENS`` scheduled tokens leave a core while other processes use one
    (``core_sharing.CoreSharing`` moves ``small``). Under data parallelism each engine core
    takes its share of the cores (at least one): engines that each took every core would run
    ``data_parallel_size`` times as many threads as there are cores, each stalling the others'
    parallel regions.

    Why, measured on a quiet 2-core machine (issue 12; the server README has the figures): a
    1,500-token prefill runs 1.7x faster on two threads than on one; served, two threads for
    every step made 1.1-1.6x the output tokens of one thread for steps under 32 tokens (tiny
    Llama and hidden 512, concurrency 1 to 64) and cut a prefix-cached 1,500-token prompt's time
    to first token from 12.9 to 10.4 ms (tiny) and 32 to 21 ms (hidden 512), once the engine's
    OpenMP threads spin briefly at a barrier instead of sleeping (``core_client.ENGINE_OMP_ENV``:
    with sleeping threads, each of a small step's parallel regions paid a wake-up and two
    threads lost 2.6x at concurrency 1). With two CPU-bound processes beside it, two threads for
    small steps lost 1.5-4x at concurrency 1, hence ``CoreSharing``. The count is not read from
    the load average at start-up: a start-up during someone else's burst must not leave the
    engine on one thread for its whole life.
    """
    from ember_worker.step_threads import StepThreads

    cores = max(1, len(os.sched_getaffinity(0)) // data_parallel_size)
    if not served:
        return StepThreads(cores)
    return StepThreads(cores, cores, large_min_tokens=SERVED_LARGE_STEP_TOKENS)


def make_engine_core(
    args: EngineArgs, model_config: ModelConfig, *, served: bool
) -> tuple[EngineCore, ModelConfig]:
    """Load the model into an in-process executor and wrap it with a scheduler.

    ``served``: the engine process of ``ember serve`` (see ``default_step_threads``).

    Returns the engine core and the model config it runs with: ``max_model_len`` lowered to what
    the KV cache holds when it was not given (see ``fit_max_model_len``).
    """
    import torch

    from ember_worker.distributed.groups import ParallelConfig
    from ember_worker.executor import InProcessExecutor
    from ember_worker.step_threads import StepThreads

    kv_cache_memory = args.kv_cache_memory
    if kv_cache_memory is None and not torch.cuda.is_available():
        kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
    step_threads = (
        StepThreads(args.num_threads)
        if args.num_threads
        else default_step_threads(served=served, data_parallel_size=args.data_parallel_size)
    )
    parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size)
    # What every executor takes alike, in process or per rank.
    model_settings = dict(
        tokenizer=model_config.tokenizer,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=model_config.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=model_config.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=kv_cache_memory,
        seed=args.seed,
    )
    if parallel.world_size > 1 or args.distributed_executor_backend not in (None, "uni"):
        executor = _rank_executor(args, model_settings, step_threads.small, parallel)
    else:
        executor = InProcessExecutor(
            args.model,
            **model_settings,
            num_threads=step_threads,
            kv_transfer_config=args.kv_transfer,
            speculative_config=args.speculative_config,
        )
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=model_config.max_num_batched_tokens,
        max_model_len=model_config.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        policy=args.scheduling_policy,
        num_lookahead_tokens=(
            args.speculative_config.num_lookahead_tokens if args.speculative_config else 0
        ),
        # Data-parallel front ends route by what each engine's prefix cache holds.
        enable_kv_events=args.data_parallel_size > 1 and args.enable_prefix_caching,
        async_scheduling=args.use_async_scheduling,
    )
    engine_core = EngineCore(
        executor, scheduler_config, executor.grammar_compiler, args.kv_transfer
    )
    return engine_core, fit_max_model_len(args, model_config, engine_core, kv_cache_memory)


def fit_max_model_len(
    args: EngineArgs, model_config: ModelConfig, engine_core, kv_cache_memory: int | None
) -> ModelConfig:
    """``model_config`` if one sequence of ``max_model_len`` tokens fits in the KV cache.

    Else: a ``ValueError`` naming both numbers and the fix when ``max_model_len`` was given; the
    model's own context lowered to what fits, with a warning, when it was not. (The scheduler
    already holds sequences to what fits; this makes the limit the one clients are told.)
    """
    capacity = engine_core.max_num_tokens  # the usable blocks' tokens, if below max_model_len
    wanted = model_config.max_model_len
    if wanted <= capacity:
        return model_config
    executor = engine_core.executor
    block_size = executor.block_size
    if args.max_model_len is not None:
        reserved = executor.num_kv_blocks - engine_core.scheduler.num_kv_blocks
        needed_blocks = -(-wanted // block_size) + reserved
        if kv_cache_memory is None:  # a GPU cache sized from free memory
            raise_budget = "Give a larger KV cache in bytes (--kv-cache-memory)"
        else:
            # The budget is split into whole blocks (on every rank alike), so it scales linearly.
            needed = -(-kv_cache_memory * needed_blocks // executor.num_kv_blocks)
            raise_budget = f"Raise kv_cache_memory (--kv-cache-memory) to at least {needed} bytes"
        raise ValueError(
            f"max_model_len {wanted} is more than the KV cache holds for one sequence: "
            f"{capacity} tokens in blocks of {block_size}. {raise_budget}, or lower "
            f"max_model_len (--max-model-len) to {capacity} or less."
        )
    logger.warning(
        "lowering max_model_len from the model's %d to %d tokens, all that the KV cache holds "
        "for one sequence; raise --kv-cache-memory for the full context",
        wanted,
        capacity,
    )
    return dataclasses.replace(model_config, max_model_len=capacity)


def _rank_executor(args, model_settings, num_threads, parallel):
    """The multiprocess or Ray executor (``distributed_executor_backend``) for several ranks."""
    from ember_worker.distributed.worker import WorkerConfig
    from ember_worker.executor_factory import make_executor

    if args.speculative_config is not None:
        raise ValueError(
            "speculative_config needs the in-process executor (one rank); it is not implemented "
            "with worker processes or Ray"
        )
    worker_config = WorkerConfig(
        args.model,
        **model_settings,
        num_threads=max(1, num_threads // parallel.world_size),
        parallel=parallel,
    )
    return make_executor(
        worker_config, args.distributed_executor_backend, kv_transfer_config=args.kv_transfer
    )
