"""The block pool: allocation, reference counts, lazy LRU eviction and the prefix-cache index."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ember_kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock, PartialBlock
from ember_kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from ember_kv_cache.hashing import ExtraKey


class BlockPool:
    """A fixed set of ``num_blocks`` KV cache blocks; block 0 is the null block.

    The null block is never handed out (engines pad block tables with it). A block whose
    reference count drops to zero joins the free queue but keeps its hash, so a later request
    can still hit it; it is evicted only when the queue hands it out again. Freed uncached blocks
    go to the front of the queue and freed cached blocks to the back, so the eviction order is:
    uncached blocks first, then cached ones from least recently used.

    Blocks can also be indexed by their tokens, under the chain hash of the blocks before them,
    at most ``MAX_PARTIAL_PER_PARENT`` per parent (the oldest leaves the index): partly filled
    blocks of finished requests (``cache_partial_block``; free and never shared) and cached whole
    blocks (``index_block_tokens``). A request whose next tokens match the start of one can copy
    its KV (``find_partial_block``) instead of computing it.
    """

    MAX_PARTIAL_PER_PARENT = 4

    def __init__(
        self, num_blocks: int, *, enable_caching: bool = True, enable_kv_events: bool = False
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(0, is_null=True)]
        self.blocks.extend(KVCacheBlock(block_id) for block_id in range(1, num_blocks))
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.partial_blocks: dict[bytes, list[KVCacheBlock]] = {}  # oldest first
        self.kv_event_queue: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the non-null blocks in use by some request."""
        usable = self.num_blocks - 1
        return (usable - self.free_block_queue.num_free_blocks) / usable

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting cached ones."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        popleft = self.free_block_queue.popleft
        new_blocks = []
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            if block.partial is not None:
                self._forget_partial(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        if self.enable_kv_events:
            self.kv_event_queue.append(
                BlockRemoved(block_hash=block_hash, block_id=block.block_id, group=block.group)
            )

    def cache_partial_block(self, block: KVCacheBlock, partial: PartialBlock) -> None:
        """Index a partly filled block that its (only) request is about to free."""
        if block.ref_cnt != 1 or block.block_hash is not None or block.partial is not None:
            raise ValueError(f"block {block.block_id} cannot be cached as a partial block")
        self._index(block, partial)

    def index_block_tokens(self, block: KVCacheBlock, tokens: PartialBlock) -> None:
        """Index a cached whole block by its tokens too (it leaves the index when evicted)."""
        if block.block_hash is None or block.partial is not None:
            raise ValueError(f"block {block.block_id} is not a newly cached whole block")
        self._index(block, tokens)

    def _index(self, block: KVCacheBlock, partial: PartialBlock) -> None:
        block.partial = partial
        siblings = self.partial_blocks.setdefault(partial.parent_hash, [])
        siblings.append(block)
        if len(siblings) > self.MAX_PARTIAL_PER_PARENT:
            self._forget_partial(siblings[0])

    def find_partial_block(
        self,
        parent_hash: bytes,
        extra_keys: tuple,
        token_ids: Sequence[int],
        exclude: set[int] = frozenset(),
    ) -> tuple[KVCacheBlock | None, int]:
        """The indexed block under ``parent_hash`` (none of the ids in ``exclude``) whose tokens
        share the longest start with ``token_ids``, and that length (``(None, 0)`` when none
        shares any)."""
        best, best_len = None, 0
        for block in self.partial_blocks.get(parent_hash, ()):
            partial = block.partial
            if partial.extra_keys != extra_keys or block.block_id in exclude:
                continue
            length = 0
            for cached, wanted in zip(partial.token_ids, token_ids):
                if cached != wanted:
                    break
                length += 1
            if length > best_len:
                best, best_len = block, length
        return best, best_len

    def _forget_partial(self, block: KVCacheBlock) -> None:
        parent_hash = block.partial.parent_hash
        siblings = self.partial_blocks[parent_hash]
        siblings.remove(block)
        if not siblings:
            del self.partial_blocks[parent_hash]
        block.partial = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hits), taking free ones off the queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.is_null:  # a placeholder for KV that left a sliding window
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in the
        given order (uncached ones at the front, cached ones at the back)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block.is_null:
                raise ValueError(f"double free of block {block.block_id} (no reference held)")
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None and block.partial is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def cache_full_block(
        self,
        block: KVCacheBlock,
        block_hash: bytes,
        parent_block_hash: bytes | None,
        token_ids: Sequence[int],
        extra_keys: tuple[ExtraKey, ...],
        group: int = 0,
    ) -> None:
        """Enter a newly full block into the prefix cache under ``block_hash`` (of layer group
        ``group``, which its events name).

        If another block already holds the same hash, this one stays uncached (a duplicate that
        is reused first once freed).
        """
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        block.group = group
        self.cached_block_hash_to_block[block_hash] = block
        if self.enable_kv_events:
            self.kv_event_queue.append(
                BlockStored(
                    block_hash=block_hash,
                    parent_block_hash=parent_block_hash,
                    token_ids=tuple(int(t) for t in token_ids),
                    extra_keys=extra_keys,
                    block_id=block.block_id,
                    group=group,
                )
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        for siblings in self.partial_blocks.values():
            for block in siblings:
                block.partial = None
        self.partial_blocks.clear()
        if self.enable_kv_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Every event recorded since the last call, oldest first."""
        events = self.kv_event_queue
        self.kv_event_queue = []
        return events
