"""The KV cache manager an engine core builds for its executor's model: by the layers' specs."""

from __future__ import annotations

from ember_kv_cache import (
    FullAttentionSpec,
    HybridKVCacheManager,
    KVCacheManager,
    KVTransferConfig,
    LocalAttentionManager,
    SlidingWindowSpec,
    group_layers_evenly,
)
from ember_kv_cache.group_chunks import check_connector_specs
from ember_scheduler.config import SchedulerConfig


def make_kv_cache_manager(
    executor, config: SchedulerConfig, kv_transfer_config: KVTransferConfig | None
) -> KVCacheManager:
    """By the executor's ``kv_cache_specs`` (one per layer; absent: full attention), grouped
    as the worker groups them (``group_layers_evenly``): a ``KVCacheManager`` for one group of
    full attention, a ``LocalAttentionManager`` for one group with a sliding window or local
    chunk (it frees the blocks that left it), and a ``HybridKVCacheManager`` for several groups
    (Gemma's local and global layers), its tables interleaved into the one block-table row per
    request that the worker keeps. A KV connector serves every kind but state groups (Mamba)."""
    specs = getattr(executor, "kv_cache_specs", None) or [FullAttentionSpec()]
    drafts = config.num_speculative_tokens
    if drafts:
        # With async scheduling a step is scheduled as if the drafts in flight were accepted; a
        # window that keeps that many more tokens still holds what a rollback's queries read.
        specs = [_widened(spec, drafts) for spec in specs]
    groups = group_layers_evenly(specs)
    settings = dict(
        enable_caching=config.enable_prefix_caching,
        hash_algo=config.prefix_caching_hash_algo,
        enable_kv_events=config.enable_kv_events,
    )
    spec = groups[0].spec
    if kv_transfer_config:
        check_connector_specs([group.spec for group in groups])
        if drafts and (len(groups) > 1 or not isinstance(spec, FullAttentionSpec)):
            # The worker checks loaded windows against the model's specs, not widened ones.
            raise ValueError(
                "kv_transfer_config: the KV connector serves a sliding-window model without "
                "speculative decoding only"
            )
    if len(groups) > 1:
        return HybridKVCacheManager(
            executor.num_kv_blocks,
            executor.block_size,
            [group.spec for group in groups],
            interleave_block_ids=True,
            **settings,
        )
    if not isinstance(spec, FullAttentionSpec):
        return LocalAttentionManager(executor.num_kv_blocks, executor.block_size, spec, **settings)
    return KVCacheManager(
        executor.num_kv_blocks,
        executor.block_size,
        # A connector's chunks start at block boundaries: with one, hits stay whole blocks.
        reuse_partial_blocks=kv_transfer_config is None,
        **settings,
    )


def _widened(spec, num_tokens: int):
    """``spec`` keeping ``num_tokens`` more of a request's latest tokens (a window only)."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowSpec(spec.window + num_tokens)
    return spec
