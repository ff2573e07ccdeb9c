"""Pick the executor for a worker configuration: in process, one process per rank, or Ray."""

from __future__ import annotations

import msgspec

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
    """An ``Executor`` for ``config``: ``backend`` None picks "uni" for one rank, else "mp".

    A KV connector (``kv_transfer_config``) runs in process or with "mp" (each rank its own
    shard); "ray" refuses it."""
    world = config.parallel.world_size
    if backend is None:
        backend = "uni" if world == 1 else "mp"
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}"
        )
    if backend == "uni":
        if world > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor x pipeline parallel "
                f"size is {world} (use 'mp' or 'ray')"
            )
        from ember_worker.executor import InProcessExecutor

        settings = msgspec.structs.asdict(config)
        del settings["parallel"]
        return InProcessExecutor(
            settings.pop("model"), device=device, kv_transfer_config=kv_transfer_config, **settings
        )
    if kv_transfer_config is not None:
        if backend == "ray":
            raise ValueError(
                "kv_transfer_config is not implemented with distributed_executor_backend 'ray' "
                "(use 'mp')"
            )
        config = msgspec.structs.replace(config, kv_transfer=kv_transfer_config.as_dict())
    if backend == "mp":
        from ember_worker.distributed.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config, device=device)
    from ember_worker.distributed.ray_executor import RayExecutor

    return RayExecutor(config, device=device)
