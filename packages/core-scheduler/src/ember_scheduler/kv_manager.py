"""The KV cache manager an engine core builds for its executor's model: by the layers' specs."""

from __future__ import annotations

from ember_kv_cache import (
    FullAttentionSpec,
    KVCacheManager,
    KVTransferConfig,
    LocalAttentionManager,
    group_layers,
)
from ember_scheduler.config import SchedulerConfig


def make_kv_cache_manager(
    executor, config: SchedulerConfig, kv_transfer_config: KVTransferConfig | None
) -> KVCacheManager:
    """A ``LocalAttentionManager`` where every layer has one sliding window (or local chunk),
    which frees the blocks that left it; otherwise a ``KVCacheManager`` keeping every token.

    The executor's ``kv_cache_specs`` (one per layer; absent: full attention) decide. A model
    whose layers mix specs keeps every token in one table for now (its windows still apply
    inside attention): the worker reads one block table per step.
    """
    specs = getattr(executor, "kv_cache_specs", None) or [FullAttentionSpec()]
    groups = group_layers(specs)
    settings = dict(
        enable_caching=config.enable_prefix_caching,
        hash_algo=config.prefix_caching_hash_algo,
        enable_kv_events=config.enable_kv_events,
    )
    spec = groups[0].spec
    if len(groups) == 1 and not isinstance(spec, FullAttentionSpec):
        if kv_transfer_config is not None:
            raise ValueError(
                f"kv_transfer_config: the KV connector serves full-attention models only; this "
                f"model's layers are all {spec}"
            )
        return LocalAttentionManager(executor.num_kv_blocks, executor.block_size, spec, **settings)
    return KVCacheManager(
        executor.num_kv_blocks,
        executor.block_size,
        # A connector's chunks start at block boundaries: with one, hits stay whole blocks.
        reuse_partial_blocks=kv_transfer_config is None,
        **settings,
    )
