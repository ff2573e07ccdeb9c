"""Building the engine core (scheduler + in-process executor) from ``EngineArgs``."""

from __future__ import annotations

import os

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_server.engine_args import EngineArgs
from ember_server.model_config import ModelConfig

# KV cache budget when none is given and the model runs on the CPU (the worker sizes GPU caches
# from free memory itself).
DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 1024**2


def default_num_threads(*, front_end_alongside: bool) -> int:
    """torch's intra-op threads when ``EngineArgs.num_threads`` is None: the cores this process
    may use that other processes are not keeping busy (the 1-minute load average, scaled to
    them), less one where a front end process runs alongside (``ember serve``), at least one.

    Measured on a 2-core machine: idle, two threads beat one offline by up to 39% (``LLM``'s front
    end works between steps, in the same thread); with the cores already busy, two threads ran
    many times slower than one, each barrier waiting for a descheduled thread.
    """
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0] / (os.cpu_count() or cores)
    busy = round(cores * min(1.0, load))
    return max(1, cores - busy - (1 if front_end_alongside else 0))


def make_engine_core(
    args: EngineArgs, model_config: ModelConfig, *, front_end_alongside: bool
) -> EngineCore:
    """Load the model into an in-process executor and wrap it with a scheduler.

    ``front_end_alongside``: a front end process shares the cores (see ``default_num_threads``).
    """
    import torch

    from ember_worker.executor import InProcessExecutor

    kv_cache_memory = args.kv_cache_memory
    if kv_cache_memory is None and not torch.cuda.is_available():
        kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
    executor = InProcessExecutor(
        args.model,
        tokenizer=model_config.tokenizer,
        dtype=args.dtype,
        max_model_len=model_config.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=model_config.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=kv_cache_memory,
        seed=args.seed,
        num_threads=args.num_threads
        or default_num_threads(front_end_alongside=front_end_alongside),
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
    )
    return EngineCore(executor, scheduler_config, executor.grammar_compiler, args.kv_transfer)
