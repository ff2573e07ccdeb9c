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


def default_num_threads() -> int:
    """Cores this process may use, less one for the front end: on a small machine, torch's
    default of one thread per core makes its threads spin against the front end's work."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def make_engine_core(args: EngineArgs, model_config: ModelConfig) -> EngineCore:
    """Load the model into an in-process executor and wrap it with a scheduler."""
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
        num_threads=args.num_threads or default_num_threads(),
        kv_transfer_config=args.kv_transfer,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=model_config.max_num_batched_tokens,
        max_model_len=model_config.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        policy=args.scheduling_policy,
    )
    return EngineCore(executor, scheduler_config, executor.grammar_compiler, args.kv_transfer)
