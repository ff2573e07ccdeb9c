"""A hierarchy of KV tiers: write through to all, read the first that has a chunk, promote it.

Keys are a chunk's chain hash (``BlockHasher``'s hash of the chunk's last block, which covers
every token before it) under a ``LayoutFingerprint``. A damaged or foreign entry is never
returned: it is logged, counted, removed from its tier, and the lookup goes on down the
hierarchy. A tier whose backend fails is skipped, with one warning, for ``retry_after`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ember_kv_cache.tier_entry import EntryError, LayoutFingerprint, decode_entry, encode_entry
from ember_kv_cache.tiers import KVTier, TierUnavailable

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    """One tier's activity since the last ``take_stats()``: lookups (``queries``) and
    ``hits`` in chunks, bytes moved, seconds per load and per store, entries rejected by the
    integrity checks (``invalid_entries``) and backend failures (``errors``)."""

    queries: int = 0
    hits: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: list[float] = field(default_factory=list)
    store_seconds: list[float] = field(default_factory=list)
    invalid_entries: int = 0
    errors: int = 0


class TieredKVStore:
    """Put, get, contains and evict KV chunks (bytes or numpy arrays) across ``tiers``, first
    tier first. Thread-safe: an engine's scheduler, loader and saver threads share one store."""

    def __init__(
        self,
        tiers: Sequence[KVTier],
        fingerprint: LayoutFingerprint,
        *,
        retry_after: float = 5.0,
    ) -> None:
        if not tiers:
            raise ValueError("TieredKVStore needs at least one tier")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.retry_after = retry_after
        self._down_until = [0.0] * len(self.tiers)
        self._stats = {tier.name: TierStats() for tier in self.tiers}
        self._lock = threading.Lock()

    def put(self, chunk_hash: bytes, value: bytes | np.ndarray) -> None:
        """Store a chunk in every tier that is up."""
        data = encode_entry(self.fingerprint, chunk_hash, value)
        key = self.fingerprint.tier_key(chunk_hash)
        for index in range(len(self.tiers)):
            self._put_one(index, key, data)

    def get(self, chunk_hash: bytes) -> bytes | np.ndarray | None:
        """The chunk from the first tier holding a valid copy (copied into the tiers above it),
        or None."""
        key = self.fingerprint.tier_key(chunk_hash)
        for index, tier in enumerate(self.tiers):
            if not self._is_up(index):
                continue
            start = time.perf_counter()
            try:
                data = tier.get(key)
            except TierUnavailable as exc:
                self._mark_down(index, exc)
                continue
            stats = self._stats[tier.name]
            if data is None:
                with self._lock:
                    stats.queries += 1
                continue
            try:
                value = decode_entry(data, self.fingerprint, chunk_hash)
            except EntryError as exc:
                logger.warning("KV %s tier: dropping entry %s: %s", tier.name, key, exc)
                with self._lock:
                    stats.queries += 1
                    stats.invalid_entries += 1
                self._evict_one(index, key)
                continue
            with self._lock:
                stats.queries += 1
                stats.hits += 1
                stats.bytes_loaded += len(data)
                stats.load_seconds.append(time.perf_counter() - start)
            for upper in range(index):
                self._put_one(upper, key, data)
            return value
        return None

    def contains(self, chunk_hash: bytes) -> bool:
        """Whether some tier that is up holds the chunk (its integrity is checked on ``get``)."""
        return self.contains_many([chunk_hash])[0]

    def contains_many(self, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """``contains`` of each chunk, asking each tier once for the chunks not found above it."""
        keys = [self.fingerprint.tier_key(chunk_hash) for chunk_hash in chunk_hashes]
        found = [False] * len(keys)
        for index, tier in enumerate(self.tiers):
            missing = [i for i, hit in enumerate(found) if not hit]
            if not missing:
                break
            if not self._is_up(index):
                continue
            try:
                hits = tier.contains_many([keys[i] for i in missing])
            except TierUnavailable as exc:
                self._mark_down(index, exc)
                continue
            for i, hit in zip(missing, hits, strict=True):
                found[i] = hit
        return found

    def evict(self, chunk_hash: bytes) -> None:
        """Remove a chunk from every tier that is up."""
        key = self.fingerprint.tier_key(chunk_hash)
        for index in range(len(self.tiers)):
            self._evict_one(index, key)

    def take_stats(self) -> dict[str, TierStats]:
        """Each tier's statistics since the last call; the counters start again from zero."""
        with self._lock:
            stats = self._stats
            self._stats = {tier.name: TierStats() for tier in self.tiers}
        return stats

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def _put_one(self, index: int, key: str, data: bytes) -> None:
        if not self._is_up(index):
            return
        tier = self.tiers[index]
        start = time.perf_counter()
        try:
            tier.put(key, data)
        except TierUnavailable as exc:
            self._mark_down(index, exc)
            return
        with self._lock:
            stats = self._stats[tier.name]
            stats.bytes_stored += len(data)
            stats.store_seconds.append(time.perf_counter() - start)

    def _evict_one(self, index: int, key: str) -> None:
        if not self._is_up(index):
            return
        try:
            self.tiers[index].evict(key)
        except TierUnavailable as exc:
            self._mark_down(index, exc)

    def _is_up(self, index: int) -> bool:
        return self._down_until[index] <= time.monotonic()

    def _mark_down(self, index: int, exc: Exception) -> None:
        tier = self.tiers[index]
        with self._lock:
            self._stats[tier.name].errors += 1
            self._down_until[index] = time.monotonic() + self.retry_after
        logger.warning(
            "KV %s tier unavailable, skipped for %.0f s (lookups miss and the engine recomputes): %s",
            tier.name,
            self.retry_after,
            exc,
        )
