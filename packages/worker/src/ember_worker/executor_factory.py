"""Pick the executor for a worker configuration: in process, one process per rank, or Ray.

Imports no torch until an executor is made: the API server reads ``EXECUTOR_BACKENDS``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from ember_kv_cache import KVTransferConfig
    from ember_worker.distributed.worker import WorkerConfig

# As vLLM's distributed_executor_backend: one rank in process, one process per rank, Ray actors.
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def make_executor(
    config: WorkerConfig,
    backend: str | None = None,
    device: str | None = None,
    kv_transfer_config: KVTransferConfig | None = None,
):
    """An ``Executor`` running ``config``'s ``Worker`` on each rank: ``backend`` None picks "uni"
    (in process) for one rank, else "mp" (always "mp" for data-parallel replicas in one
    expert-parallel world). ``kv_transfer_config``, when given, replaces
    ``config.kv_transfer``.

    A KV connector and speculative decoding run with every backend (each rank its own shard)."""
    parallel = config.parallel
    if backend is None:
        # Replicas in one expert-parallel world run their ranks in worker processes: the
        # engine core's own process keeps its torch.distributed world for the lock-step.
        backend = "uni" if parallel.world_size == 1 and not parallel.spans_data_parallel else "mp"
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}"
        )
    if parallel.spans_data_parallel and backend != "mp":
        raise ValueError(
            "distributed_executor_backend: data-parallel attention with expert parallelism "
            f"runs on 'mp', got {backend!r}"
        )
    if kv_transfer_config is not None:
        config = msgspec.structs.replace(config, kv_transfer=kv_transfer_config.as_dict())
    if backend == "uni":
        from ember_worker.executor import InProcessExecutor

        return InProcessExecutor(config, device=device)
    if backend == "mp":
        from ember_worker.distributed.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, device=device)
    from ember_worker.distributed.ray_executor import RayExecutor

    return RayExecutor(config, device=device)
