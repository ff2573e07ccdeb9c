"""Block tables for layers that do not keep every token: local attention and fixed-size state.

``LocalAttentionManager`` serves a sliding window or chunked local attention: the blocks whose
tokens no later query sees go back to the pool at each step, and the null block takes their
place in the table (so a token still lives at ``block_table[i // block_size]``). ``StateManager``
keeps one block per request for a Mamba or linear-attention state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ember_kv_cache.block import KVCacheBlock
from ember_kv_cache.computed_blocks import ComputedBlocks
from ember_kv_cache.counts import bad_counts
from ember_kv_cache.hashing import BlockHashExtras
from ember_kv_cache.manager import KVCacheManager, _RequestBlocks
from ember_kv_cache.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec, StateSpec


def longest_hit(
    block_hashes: Sequence[bytes],
    cached: dict[bytes, KVCacheBlock],
    num_skipped_blocks: Callable[[int], int],
) -> int:
    """The largest ``n <= len(block_hashes)`` whose needed blocks (``num_skipped_blocks(n)`` to
    ``n - 1``) are all cached, searched from the right: a local layer needs only the blocks its
    next query sees, the tail of the prefix. Each hash is looked up at most once."""
    n = len(block_hashes)
    index = n - 1
    while n > 0:
        low = num_skipped_blocks(n)
        while index >= low and block_hashes[index] in cached:
            index -= 1
        if index < low:
            return n
        n = index  # block ``index`` is missing: a hit must end before it
        index = n - 1
    return 0


def blocks_needed(
    manager: KVCacheManager,
    request_id: str,
    token_ids: Sequence[int],
    num_new_tokens: int,
    *,
    num_computed_tokens: int = 0,
    computed: ComputedBlocks | None = None,
    num_lookahead_tokens: int = 0,
    extras: BlockHashExtras | None = None,
) -> int | None:
    """How many blocks ``manager.allocate_slots`` with these arguments would take off the free
    queue (None: more than are free); changes nothing. A hybrid manager asks every group before
    allocating in any."""
    try:
        counts_ok = (num_new_tokens | num_computed_tokens | num_lookahead_tokens) >= 0
    except TypeError:
        counts_ok = False
    if not counts_ok:
        raise ValueError(bad_counts(num_new_tokens, num_computed_tokens, num_lookahead_tokens))
    state = manager._requests.get(request_id)
    if (
        state is not None
        and computed is None
        and num_computed_tokens + num_new_tokens + num_lookahead_tokens <= state.capacity
    ):
        return 0  # the common path of a running request: its blocks have room
    return manager._allocate_slots(
        request_id,
        state,
        token_ids,
        num_new_tokens,
        num_computed_tokens,
        computed,
        num_lookahead_tokens,
        extras,
        False,
        dry_run=True,
    )


class LocalAttentionManager(KVCacheManager):
    """``KVCacheManager`` for layers with a sliding window or chunked local attention.

    The same calls and results, and these differences: ``allocate_slots`` first frees the blocks
    that left the window (also when it then returns None: they are no longer needed), replacing
    them with the null block 0 in the table; ``get_computed_blocks`` finds the longest prefix
    whose tail (the blocks the next query sees) is cached, and its blocks before that tail are
    the null block; ``reuse_partial_blocks`` is off; ``get_num_common_prefix_blocks`` is 0.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        spec: SlidingWindowSpec | ChunkedLocalAttentionSpec,
        **settings,
    ) -> None:
        if not isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
            raise ValueError(f"spec must be a sliding-window or chunked local spec, got {spec!r}")
        settings["reuse_partial_blocks"] = False
        super().__init__(num_blocks, block_size, **settings)
        self.spec = spec
        self._num_skipped_tokens = spec.num_skipped_tokens
        self._skipped: dict[str, int] = {}  # request id -> leading blocks freed so far

    def _num_skipped_blocks(self, num_blocks: int) -> int:
        return self._num_skipped_tokens(num_blocks * self.block_size) // self.block_size

    def get_computed_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        extras: BlockHashExtras | None = None,
    ) -> ComputedBlocks:
        """The longest cached prefix the next query can continue from, in whole blocks (the
        null block where the window no longer reaches), leaving at least one token."""
        if extras is not None and not isinstance(extras, BlockHashExtras):
            raise ValueError(f"extras must be a BlockHashExtras or None, got {extras!r}")
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        num_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        hashes = list(self.hasher.chain(token_ids, num_blocks, extras=extras))
        result = self.computed_from_hashes(hashes, num_blocks, extras)
        self._stats.record(len(token_ids), result.num_computed_tokens)
        return result

    def computed_from_hashes(
        self, hashes: Sequence[bytes], max_blocks: int, extras: BlockHashExtras | None
    ) -> ComputedBlocks:
        """The hit among the first ``max_blocks`` of a prompt's block ``hashes`` (no stats)."""
        cached = self.block_pool.cached_block_hash_to_block
        num_hit = longest_hit(hashes[:max_blocks], cached, self._num_skipped_blocks)
        num_null = self._num_skipped_blocks(num_hit)
        null = self.block_pool.null_block
        blocks = [null] * num_null + [cached[h] for h in hashes[num_null:num_hit]]
        return ComputedBlocks(
            [block.block_id for block in blocks],
            num_hit * self.block_size,
            tuple(blocks),
            tuple(hashes[:num_hit]),
            extras,
        )

    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int, **kw):
        """``KVCacheManager.allocate_slots``, after freeing the blocks that left the window."""
        self._free_left_window(request_id, kw.get("num_computed_tokens", 0))
        return super().allocate_slots(request_id, token_ids, num_new_tokens, **kw)

    def blocks_needed(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int, **kw):
        """Blocks ``allocate_slots`` would take off the free queue now (None: more than are
        free), after freeing what left the window; allocates nothing."""
        self._free_left_window(request_id, kw.get("num_computed_tokens", 0))
        return blocks_needed(self, request_id, token_ids, num_new_tokens, **kw)

    def _free_left_window(self, request_id: str, num_computed: int) -> None:
        state = self._requests.get(request_id)
        if state is not None and num_computed >= state.skip_boundary:
            self._free_skipped(request_id, state, num_computed)

    def _free_skipped(self, request_id: str, state: _RequestBlocks, num_computed: int) -> None:
        if num_computed > state.capacity:
            return  # allocate_slots refuses it with its own error
        first = self._skipped.get(request_id, 0)
        last = min(self._num_skipped_tokens(num_computed) // self.block_size, len(state.blocks))
        null = self.block_pool.null_block
        freed = []
        for index in range(first, last):
            block = state.blocks[index]
            if not block.is_null:
                freed.append(block)
                state.blocks[index] = null
                state.block_ids[index] = 0
        # Oldest first: among cached free blocks the earliest of the prompt is evicted first.
        self.block_pool.free_blocks(freed)
        self._skipped[request_id] = last
        state.skip_boundary = self._skip_boundary(last)

    def _skip_boundary(self, num_skipped_blocks: int) -> int:
        """The smallest computed-token count at which block ``num_skipped_blocks`` is skipped."""
        target = (num_skipped_blocks + 1) * self.block_size
        if isinstance(self.spec, SlidingWindowSpec):
            return target + self.spec.window - 1
        return -(-target // self.spec.chunk_size) * self.spec.chunk_size

    def _new_request_state(self, extras: BlockHashExtras | None) -> _RequestBlocks:
        state = super()._new_request_state(extras)
        state.skip_boundary = self._skip_boundary(0)
        return state

    def free(
        self,
        request_id: str,
        token_ids: Sequence[int] | None = None,
        num_computed_tokens: int = 0,
    ) -> None:
        """Release the request's blocks still held, last first."""
        state = self._requests.pop(request_id, None)
        if state is None:
            raise ValueError(
                f"cannot free unknown request {request_id!r} (never allocated or already freed)"
            )
        self._skipped.pop(request_id, None)
        self.block_pool.free_blocks([block for block in state.blocks[::-1] if not block.is_null])

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """0: the leading blocks of a request leave its window (no shared cascade prefix)."""
        self._get_state(request_id)
        return 0


class StateManager:
    """One block per request for a fixed-size state (``StateSpec``): its id is the state's slot.

    Prefix caching does not apply (a state summarizes every token before it): lookups find
    nothing. The calls mirror ``KVCacheManager``'s for a hybrid manager to drive.
    """

    def __init__(self, num_blocks: int, block_size: int, spec: StateSpec, *, block_pool) -> None:
        if not isinstance(spec, StateSpec):
            raise ValueError(f"spec must be a StateSpec, got {spec!r}")
        self.spec = spec
        self.block_size = block_size
        self.block_pool = block_pool
        self._blocks: dict[str, KVCacheBlock] = {}

    def computed_from_hashes(self, hashes, max_blocks, extras) -> ComputedBlocks:
        return ComputedBlocks([], 0, extras=extras)

    def blocks_needed(self, request_id: str, token_ids, num_new_tokens: int, **kw) -> int | None:
        need = 0 if request_id in self._blocks else 1
        return need if need <= self.block_pool.num_free_blocks else None

    def allocate_slots(self, request_id: str, token_ids, num_new_tokens: int, **kw):
        if request_id in self._blocks:
            return []
        if not self.block_pool.num_free_blocks:
            return None
        (block,) = self.block_pool.get_new_blocks(1)
        self._blocks[request_id] = block
        return [block.block_id]

    def free(self, request_id: str, token_ids=None, num_computed_tokens: int = 0) -> None:
        block = self._blocks.pop(request_id, None)
        if block is None:
            raise ValueError(
                f"cannot free unknown request {request_id!r} (never allocated or already freed)"
            )
        self.block_pool.free_blocks([block])

    def get_block_ids(self, request_id: str) -> list[int]:
        if request_id not in self._blocks:
            raise ValueError(f"unknown request {request_id!r}")
        return [self._blocks[request_id].block_id]

    def take_block_copies(self) -> list[tuple[int, int]]:
        return []
