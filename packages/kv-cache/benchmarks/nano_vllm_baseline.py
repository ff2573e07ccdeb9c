"""The baseline the benchmarks measure against in the same run: nano-vllm's block manager.

Written here after its design: a ``deque`` of free block ids (``popleft`` to allocate,
``deque.remove`` to take a cached free block back on a prefix hit, ``append`` to free), a dict
from block hash to block id, and chained xxh64 hashes computed incrementally, once per full
block, from the previous block's hash and the block's token ids.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash


def compute_hash(token_ids, prefix: int = -1) -> int:
    """xxh64 of the parent hash (when there is one) and the block's token ids."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.array(token_ids).tobytes())
    return h.intdigest()


class DequeFreeListPool:
    """Reference counts plus a deque of free block ids."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_cnt = [0] * num_blocks
        self.free_block_ids = deque(range(1, num_blocks))

    def get_new_blocks(self, n: int) -> list[int]:
        blocks = [self.free_block_ids.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self.free_block_ids.remove(b)
            self.ref_cnt[b] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_block_ids.append(b)


class NanoVLLMBlockManager:
    """Prefix caching over ``DequeFreeListPool`` with incremental chained hashes per sequence."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = DequeFreeListPool(num_blocks)
        self.block_size = block_size
        self.hash_to_block_id: dict[int, int] = {}
        self.block_hash = [-1] * num_blocks
        self.tables: dict[str, list[int]] = {}
        self.last_hash: dict[str, int] = {}

    def get_computed_blocks(self, token_ids) -> list[int]:
        """Leading cached blocks, at least one token left to compute."""
        hits, h = [], -1
        size = self.block_size
        for index in range((len(token_ids) - 1) // size):
            h = compute_hash(token_ids[index * size : (index + 1) * size], h)
            block = self.hash_to_block_id.get(h)
            if block is None or self.block_hash[block] != h:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request_id, token_ids, num_new_tokens, num_computed_tokens=0):
        """Blocks for ``num_new_tokens`` more tokens; hashes each block that becomes full."""
        table = self.tables.setdefault(request_id, [])
        size = self.block_size
        num_tokens = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens // size) - len(table))
        if num_new_blocks > len(self.pool.free_block_ids):
            return None
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        for b in new_blocks:
            if self.block_hash[b] != -1:
                self.hash_to_block_id.pop(self.block_hash[b], None)
                self.block_hash[b] = -1
        table.extend(new_blocks)
        h = self.last_hash.get(request_id, -1)
        for index in range(num_computed_tokens // size, min(len(token_ids), num_tokens) // size):
            h = compute_hash(token_ids[index * size : (index + 1) * size], h)
            self.hash_to_block_id[h] = table[index]
            self.block_hash[table[index]] = h
            self.last_hash[request_id] = h
        return new_blocks

    def free(self, request_id: str) -> None:
        self.last_hash.pop(request_id, None)
        self.pool.free_blocks(self.tables.pop(request_id)[::-1])
