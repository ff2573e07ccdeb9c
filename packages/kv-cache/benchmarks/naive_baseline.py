"""The naive baseline the benchmarks measure against in the same run.

A list-based free list (``pop(0)`` to allocate, ``list.remove`` to take back a cached free block)
and block hashes recomputed from each block's whole prefix, every time, instead of chained and
incremental. Same behaviour as ``KVCacheManager`` for the calls the benchmarks make.
"""

from __future__ import annotations

import hashlib

import numpy as np


class ListFreeListPool:
    """Reference counts plus a Python list as the free list."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_cnt = [0] * num_blocks
        self.free_list = list(range(1, num_blocks))

    def get_new_blocks(self, n: int) -> list[int]:
        blocks = [self.free_list.pop(0) for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self.free_list.remove(b)
            self.ref_cnt[b] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_list.append(b)


class NaiveKVCacheManager:
    """Prefix caching over ``ListFreeListPool``, hashing every full block's whole prefix anew."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = ListFreeListPool(num_blocks)
        self.block_size = block_size
        self.cached: dict[bytes, int] = {}
        self.block_hash: dict[int, bytes] = {}
        self.tables: dict[str, list[int]] = {}

    def _prefix_hash(self, token_ids, num_blocks: int) -> bytes:
        data = np.asarray(token_ids[: num_blocks * self.block_size], dtype="<u4").tobytes()
        return hashlib.sha256(data).digest()

    def get_computed_blocks(self, token_ids) -> list[int]:
        hits = []
        for index in range((len(token_ids) - 1) // self.block_size):
            block = self.cached.get(self._prefix_hash(token_ids, index + 1))
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request_id, token_ids, num_new_tokens, num_computed_tokens=0, hits=()):
        table = self.tables.get(request_id, [])
        num_tokens = num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens // self.block_size) - len(table) - len(hits))
        free_hits = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if num_new_blocks > len(self.pool.free_list) - free_hits:
            return None
        self.pool.touch(list(hits))
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        for b in new_blocks:
            if b in self.block_hash:
                del self.cached[self.block_hash.pop(b)]
        table = [*table, *hits, *new_blocks]
        self.tables[request_id] = table
        for index in range(min(len(token_ids), num_tokens) // self.block_size):
            block_hash = self._prefix_hash(token_ids, index + 1)
            if block_hash not in self.cached and table[index] not in self.block_hash:
                self.cached[block_hash] = table[index]
                self.block_hash[table[index]] = block_hash
        return new_blocks

    def free(self, request_id: str) -> None:
        self.pool.free_blocks(self.tables.pop(request_id)[::-1])
