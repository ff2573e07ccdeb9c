"""KV cache blocks and the intrusive doubly linked queue of free blocks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class KVCacheBlock:
    """One paged block of the KV cache: its id, reference count and prefix-cache hash.

    ``prev_free_block`` / ``next_free_block`` link the block into the free queue while it is
    free, so that removing it from the middle of the queue (a prefix-cache hit on a free block)
    costs O(1). A free block that was a finished request's last, partly filled block may carry
    ``partial`` (the chain hash before it, its extra keys and the tokens whose KV it holds) until
    it is handed out again.
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "group",
        "is_null",
        "next_free_block",
        "partial",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int, *, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group = 0  # the layer group whose prefix cache holds block_hash
        self.partial: PartialBlock | None = None
        self.is_null = is_null
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest})"


class PartialBlock(NamedTuple):
    """What a free, partly filled block holds: KV of ``token_ids`` after the chain hash
    ``parent_hash``, under the block's ``extra_keys``."""

    parent_hash: bytes
    extra_keys: tuple
    token_ids: tuple[int, ...]


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order, as a doubly linked list threaded through the blocks.

    The front is evicted first. Every operation is O(1): no ``list.remove`` and no scans. Two
    sentinel blocks (id -1) bound the list so that no operation needs a special case.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the front (the next to evict)."""
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left in the free queue")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back (evicted last)."""
        self._link_after(self._tail.prev_free_block, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the front (evicted first)."""
        self._link_after(self._head, block)

    def _link_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        following = anchor.next_free_block
        block.prev_free_block = anchor
        block.next_free_block = following
        anchor.next_free_block = block
        following.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free_block
        while block is not self._tail:
            yield block
            block = block.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks
