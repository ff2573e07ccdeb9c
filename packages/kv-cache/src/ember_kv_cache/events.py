"""KV cache events a caller drains with ``KVCacheManager.take_events()``.

They let an outside index (a KV-aware router, a connector tier) mirror which blocks the prefix
cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember_kv_cache.hashing import ExtraKey


@dataclass(frozen=True)
class KVCacheEvent:
    """Base class of every KV cache event."""


@dataclass(frozen=True)
class BlockStored(KVCacheEvent):
    """A full block entered the prefix cache.

    ``parent_block_hash`` is the previous block's hash, or ``None`` for a request's first block
    (whose parent is the hasher's root hash).
    """

    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...]
    block_id: int
    group: int = 0  # the layer group (HybridKVCacheManager), 0 with one group


@dataclass(frozen=True)
class BlockRemoved(KVCacheEvent):
    """A cached block was evicted to be reused for other tokens."""

    block_hash: bytes
    block_id: int
    group: int = 0


@dataclass(frozen=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""
