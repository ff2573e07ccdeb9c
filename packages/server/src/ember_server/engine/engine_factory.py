"""Building the engine core (scheduler + executor) from ``EngineArgs``: the one place where the
user's settings become the scheduler's config and the worker's."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.lockstep import spans_engines
from ember_server.engine.model_config import ModelConfig

if TYPE_CHECKING:
    from ember_server.engine.lockstep import DataParallelPlace
    from ember_worker.distributed.worker import WorkerConfig
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

    Why (the server README has the figures): on a quiet machine every thread helps, large
    prefills and, served, small steps too, once the engine's OpenMP threads spin briefly at a
    barrier instead of sleeping (``core_client.ENGINE_OMP_ENV``: with sleeping threads each of a
    small step's parallel regions pays a wake-up). Beside CPU-bound processes, threads for small
    steps stall on the cores those processes take, hence ``CoreSharing``. The count is not read
    from the load average at start-up: a start-up during someone else's burst must not leave the
    engine on one thread for its whole life.
    """
    from ember_worker.step_threads import StepThreads

    cores = max(1, len(os.sched_getaffinity(0)) // data_parallel_size)
    if not served:
        return StepThreads(cores)
    return StepThreads(cores, cores, large_min_tokens=SERVED_LARGE_STEP_TOKENS)


def make_engine_core(
    args: EngineArgs,
    model_config: ModelConfig,
    *,
    served: bool,
    place: DataParallelPlace | None = None,
) -> tuple[EngineCore, ModelConfig]:
    """Load the model into the executor of ``args`` (in process, one process per rank, or Ray)
    and wrap it with a scheduler.

    ``served``: the engine process of ``ember serve`` (see ``default_step_threads``).
    ``place``: this engine core's among data-parallel replicas sharing one expert-parallel group
    (``lockstep``; required there).

    Returns the engine core and the model config it runs with: ``max_model_len`` lowered to what
    the KV cache holds when it was not given (see ``fit_max_model_len``).
    """
    import torch

    from ember_worker.executor_factory import make_executor

    kv_cache_memory = args.kv_cache_memory
    if kv_cache_memory is None and not torch.cuda.is_available():
        kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
    worker_config = make_worker_config(
        args, model_config, kv_cache_memory, served=served, place=place
    )
    executor = make_executor(worker_config, args.distributed_executor_backend)
    scheduler_config = make_scheduler_config(args, model_config)
    engine_core = EngineCore(
        executor, scheduler_config, executor.grammar_compiler, args.kv_transfer
    )
    return engine_core, fit_max_model_len(args, model_config, engine_core, kv_cache_memory)


def make_worker_config(
    args: EngineArgs,
    model_config: ModelConfig,
    kv_cache_memory: int | None,
    *,
    served: bool,
    place: DataParallelPlace | None = None,
) -> WorkerConfig:
    """The one ``WorkerConfig`` every rank of every executor backend is built from (``place``:
    as ``make_engine_core``'s)."""
    from ember_worker.distributed.groups import ParallelConfig
    from ember_worker.distributed.worker import WorkerConfig
    from ember_worker.step_threads import StepThreads

    step_threads = (
        StepThreads(args.num_threads)
        if args.num_threads
        else default_step_threads(served=served, data_parallel_size=args.data_parallel_size)
    )
    replicas = {}
    if spans_engines(args):
        if place is None:
            raise ValueError(
                "data_parallel_size: engine cores sharing one expert-parallel group are started "
                "by the serving front end (AsyncLLM, ember serve), each with its place"
            )
        replicas = dict(
            data_parallel_size=args.data_parallel_size,
            data_parallel_rank=place.rank,
            data_parallel_init_method=place.workers_init_method,
        )
    parallel = ParallelConfig(
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        args.enable_expert_parallel,
        args.expert_placement_strategy,
        **replicas,
    )
    if parallel.world_size > 1:
        # The ranks share this process's cores, each with the same count for every step.
        step_threads = StepThreads(max(1, step_threads.small // parallel.world_size))
    kv_transfer = args.kv_transfer
    optional = {}
    if args.gpu_memory_utilization is not None:  # else the worker's default, the only one
        optional["gpu_memory_utilization"] = args.gpu_memory_utilization
    return WorkerConfig(
        args.model,
        tokenizer=model_config.tokenizer,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=model_config.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=model_config.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=kv_cache_memory,
        seed=args.seed,
        num_threads=step_threads.large,
        small_num_threads=step_threads.small,
        large_step_min_tokens=step_threads.large_min_tokens,
        parallel=parallel,
        kv_transfer=None if kv_transfer is None else kv_transfer.as_dict(),
        speculative_config=args.speculative_config,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        lora=args.lora_config,
        expert_load_log_interval=args.expert_load_log_interval,
        **optional,
    )


def make_scheduler_config(args: EngineArgs, model_config: ModelConfig) -> SchedulerConfig:
    """The scheduler's settings of ``args`` (limits resolved by ``model_config``)."""
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=model_config.max_num_batched_tokens,
        max_model_len=model_config.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        policy=args.scheduling_policy,
        lora=args.lora_config,
        num_lookahead_tokens=(
            args.speculative_config.num_lookahead_tokens if args.speculative_config else 0
        ),
        num_speculative_tokens=(
            args.speculative_config.num_speculative_tokens if args.speculative_config else 0
        ),
        # Data-parallel front ends route by what each engine's prefix cache holds.
        enable_kv_events=args.data_parallel_size > 1 and args.enable_prefix_caching,
        async_scheduling=args.use_async_scheduling,
    )


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
