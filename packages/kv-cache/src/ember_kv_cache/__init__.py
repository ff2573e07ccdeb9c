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
from ember_kv_cache.manager import KVCacheManager
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
    "ComputedBlocks",
    "DiskTier",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorStats",
    "KVTransferConfig",
    "LayoutFingerprint",
    "MultiModalItem",
    "PrefixCacheStats",
    "RedisTier",
    "TierStats",
    "TierUnavailable",
    "TieredConnectorScheduler",
    "TieredKVStore",
    "make_tier",
]
