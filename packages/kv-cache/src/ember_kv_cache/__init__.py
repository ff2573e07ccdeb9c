"""Paged KV block pool, prefix cache and KV cache manager for LLM inference engines."""

from ember_kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from ember_kv_cache.block_pool import BlockPool
from ember_kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from ember_kv_cache.hashing import HASH_ALGOS, BlockHasher, BlockHashExtras, MultiModalItem
from ember_kv_cache.manager import ComputedBlocks, KVCacheManager
from ember_kv_cache.stats import PrefixCacheStats

__version__ = "0.1.0"

__all__ = [
    "HASH_ALGOS",
    "AllBlocksCleared",
    "BlockHashExtras",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ComputedBlocks",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "MultiModalItem",
    "PrefixCacheStats",
]
