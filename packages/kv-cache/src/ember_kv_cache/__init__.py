"""Paged KV block pool, prefix cache and KV cache manager for LLM inference engines, and a
tiered (CPU, disk, Redis) store for KV chunks shared across engines."""

from ember_kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from ember_kv_cache.block_pool import BlockPool
from ember_kv_cache.computed_blocks import ComputedBlocks
from ember_kv_cache.connector import (
    ChunkTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    KVTransferConfig,
    TieredConnectorScheduler,
)
from ember_kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from ember_kv_cache.hashing import (
    DEFAULT_HASH_ALGO,
    HASH_ALGOS,
    BlockHasher,
    BlockHashExtras,
    MultiModalItem,
)
from ember_kv_cache.hybrid_manager import HybridComputedBlocks, HybridKVCacheManager
from ember_kv_cache.manager import KVCacheManager
from ember_kv_cache.spec_managers import LocalAttentionManager, StateManager
from ember_kv_cache.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    StateSpec,
    group_layers,
    group_layers_evenly,
    max_tokens_per_request,
)
from ember_kv_cache.stats import PrefixCacheStats
from ember_kv_cache.tier_entry import LayoutFingerprint
from ember_kv_cache.tier_store import TieredKVStore, TierStats
from ember_kv_cache.tiers import CPUTier, DiskTier, RedisTier, TierUnavailable, make_tier

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_HASH_ALGO",
    "HASH_ALGOS",
    "AllBlocksCleared",
    "BlockHashExtras",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CPUTier",
    "ChunkTransfer",
    "ChunkedLocalAttentionSpec",
    "ComputedBlocks",
    "DiskTier",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "HybridComputedBlocks",
    "HybridKVCacheManager",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheManager",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorStats",
    "KVTransferConfig",
    "LayoutFingerprint",
    "LocalAttentionManager",
    "MultiModalItem",
    "PrefixCacheStats",
    "RedisTier",
    "SlidingWindowSpec",
    "StateManager",
    "StateSpec",
    "TierStats",
    "TierUnavailable",
    "TieredConnectorScheduler",
    "TieredKVStore",
    "group_layers",
    "group_layers_evenly",
    "make_tier",
    "max_tokens_per_request",
]
