"""The KV cache manager: per-request block tables on top of the block pool and prefix cache."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ember_kv_cache.block import KVCacheBlock, PartialBlock
from ember_kv_cache.block_pool import BlockPool
from ember_kv_cache.computed_blocks import ComputedBlocks
from ember_kv_cache.counts import bad_counts
from ember_kv_cache.events import KVCacheEvent
from ember_kv_cache.hashing import DEFAULT_HASH_ALGO, BlockHasher, BlockHashExtras
from ember_kv_cache.specs import FullAttentionSpec, KVCacheSpec
from ember_kv_cache.stats import PrefixCacheStats


class _RequestBlocks:
    """One request's block table and the hashes of its full blocks so far."""

    __slots__ = (
        "block_hashes",
        "block_ids",
        "blocks",
        "capacity",
        "extras",
        "hash_boundary",
        "skip_boundary",
    )

    def __init__(self, extras: BlockHashExtras | None, hash_boundary: int) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.capacity = 0  # tokens the blocks can hold
        self.extras = extras
        # Token count at which the next unhashed block becomes full (never, without caching).
        self.hash_boundary = hash_boundary
        # Token count at which the next leading block leaves a local layer's view (never, for
        # full attention; ember_kv_cache.spec_managers).
        self.skip_boundary = sys.maxsize


class KVCacheManager:
    """Paged KV memory for many requests, with prefix caching, in request / token / block ids.

    ``num_blocks`` includes the null block (id 0), which is never handed out. ``hash_algo`` is
    ``"sha256"`` (default), ``"xxhash64"`` or ``"xxhash128"`` (the last two need the ``xxhash``
    extra); managers with the same ``block_size``, ``hash_algo`` and ``hash_seed`` produce the
    same block hashes.

    With ``reuse_partial_blocks`` a prefix hit also covers the start of the block after the
    whole cached blocks when a block indexed by its tokens holds their KV: a finished request's
    last, partly filled block (``free`` given the request's token ids) or a cached whole block
    whose first tokens are the request's next ones. The request's own block then gets those
    slots by a copy, which the engine must run before its next forward writes any KV:
    ``take_block_copies``, once per step, which also ends the step (a block cached in the step,
    whose KV that step's forward has yet to write, is no copy source before it).
    """

    spec: KVCacheSpec = FullAttentionSpec()  # what its layers keep: every token
    kv_group = 0  # its index among a hybrid manager's groups (named by its KV events)

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        """The spec of each layer group: one group."""
        return (self.spec,)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = DEFAULT_HASH_ALGO,
        hash_seed: bytes = b"",
        enable_kv_events: bool = False,
        reuse_partial_blocks: bool = False,
        block_pool: BlockPool | None = None,
    ) -> None:
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        # A hybrid manager's groups share one pool (ember_kv_cache.hybrid_manager).
        self.block_pool = block_pool or BlockPool(
            num_blocks, enable_caching=enable_caching, enable_kv_events=enable_kv_events
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.reuse_partial_blocks = reuse_partial_blocks and enable_caching
        self._block_copies: list[tuple[int, int]] = []
        self._blocks_cached_this_step: set[int] = set()
        self._requests: dict[str, _RequestBlocks] = {}
        self._stats = PrefixCacheStats()
        self._first_hash_boundary = block_size if enable_caching else sys.maxsize

    @property
    def usage(self) -> float:
        """Fraction of the (non-null) blocks in use by some request."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached free blocks included."""
        return self.block_pool.free_block_queue.num_free_blocks

    def get_computed_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        extras: BlockHashExtras | None = None,
    ) -> ComputedBlocks:
        """The longest cached prefix of ``token_ids`` in whole blocks, leaving at least one token
        to compute. Takes no references (``allocate_slots`` does) and records prefix-cache
        statistics."""
        if extras is not None and not isinstance(extras, BlockHashExtras):
            raise ValueError(f"extras must be a BlockHashExtras or None, got {extras!r}")
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        size = self.block_size
        cached = self.block_pool.cached_block_hash_to_block
        blocks: list[KVCacheBlock] = []
        hashes: list[bytes] = []
        parent = self.hasher.root_hash
        num_blocks = max(0, (len(token_ids) - 1) // size)
        for block_hash in self.hasher.chain(token_ids, num_blocks, extras=extras):
            block = cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
            hashes.append(block_hash)
            parent = block_hash
        partial_block, num_partial = None, 0
        if self.reuse_partial_blocks:
            partial_block, num_partial = self._find_partial(token_ids, len(blocks), parent, extras)
        num_hit_tokens = len(blocks) * size + num_partial
        self._stats.record(len(token_ids), num_hit_tokens)
        return ComputedBlocks(
            [block.block_id for block in blocks],
            num_hit_tokens,
            tuple(blocks),
            tuple(hashes),
            extras,
            partial_block,
            num_partial,
            partial_block.partial if partial_block else None,
        )

    def _find_partial(
        self,
        token_ids: Sequence[int],
        index: int,
        parent: bytes,
        extras: BlockHashExtras | None,
    ) -> tuple[KVCacheBlock | None, int]:
        """A block holding KV of the start of block ``index`` (after the chain hash ``parent``),
        and how many of the request's tokens it covers, leaving the last token to compute."""
        size = self.block_size
        start, end = index * size, min((index + 1) * size, len(token_ids) - 1)
        if end <= start:
            return None, 0
        keys = extras.block_extra_keys(index, size) if extras is not None else ()
        return self.block_pool.find_partial_block(
            parent, keys, token_ids[start:end], self._blocks_cached_this_step
        )

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        computed: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        extras: BlockHashExtras | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens (plus ``num_lookahead_tokens``
        speculative slots) and cache every newly full block.

        With ``delay_cache_blocks`` the new tokens' blocks are not cached yet: their KV is still
        to arrive (from a KV connector); a later call with ``num_computed_tokens`` past them
        caches them.

        Returns the ids of the newly allocated blocks (possibly ``[]``), or ``None`` when the
        pool cannot serve the request, in which case nothing changed.
        """
        # The one check of the counts, cheap enough for every call: an OR of integers is
        # negative exactly when one of them is, and raises TypeError for anything not an integer.
        try:
            counts_ok = (num_new_tokens | num_computed_tokens | num_lookahead_tokens) >= 0
        except TypeError:
            counts_ok = False
        if not counts_ok:
            raise ValueError(bad_counts(num_new_tokens, num_computed_tokens, num_lookahead_tokens))
        state = self._requests.get(request_id)
        if (
            state is not None
            and computed is None
            and not delay_cache_blocks
            and (extras is None or extras is state.extras)
        ):
            # The common path of a running request: its blocks have room, no block fills up.
            end = num_computed_tokens + num_new_tokens
            if end + num_lookahead_tokens <= state.capacity and (
                end < state.hash_boundary or len(token_ids) < state.hash_boundary
            ):
                return []
        return self._allocate_slots(
            request_id,
            state,
            token_ids,
            num_new_tokens,
            num_computed_tokens,
            computed,
            num_lookahead_tokens,
            extras,
            delay_cache_blocks,
        )

    def _allocate_slots(
        self,
        request_id: str,
        state: _RequestBlocks | None,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_computed_tokens: int,
        computed: ComputedBlocks | None,
        num_lookahead_tokens: int,
        extras: BlockHashExtras | None,
        delay_cache_blocks: bool,
        dry_run: bool = False,
    ) -> list[int] | int | None:
        """``allocate_slots``; with ``dry_run`` only the number of blocks it would take off the
        free queue (or None), changing nothing."""
        if extras is not None and not isinstance(extras, BlockHashExtras):
            raise ValueError(f"extras must be a BlockHashExtras or None, got {extras!r}")
        capacity = state.capacity if state is not None else 0
        if num_computed_tokens > capacity:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} is beyond the {capacity} token slots "
                f"of request {request_id!r}'s blocks"
            )
        hit_blocks: tuple[KVCacheBlock, ...] = ()
        computed_hashes: tuple[bytes, ...] = ()
        num_partial = 0
        if computed is not None and computed.num_computed_tokens:
            if state is not None:
                raise ValueError(
                    f"computed blocks can only be taken over by a new request; "
                    f"{request_id!r} already holds blocks"
                )
            computed.check(self.block_size, extras)
            hit_blocks = computed.blocks
            computed_hashes = computed.block_hashes
            num_partial = computed.num_partial_tokens
        if state is not None and extras is not None and extras != state.extras:
            raise ValueError(f"extras of request {request_id!r} differ from its first allocation")

        size = self.block_size
        num_total_computed = num_computed_tokens + len(hit_blocks) * size + num_partial
        num_required_tokens = num_total_computed + num_new_tokens + num_lookahead_tokens
        num_required_blocks = -(-num_required_tokens // size)
        num_held_blocks = len(state.blocks) if state is not None else 0
        num_new_blocks = max(0, num_required_blocks - num_held_blocks - len(hit_blocks))
        # Hits on free blocks leave the free queue when touched, so they cannot be allocated.
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0 and not block.is_null)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            return None
        if dry_run:
            return num_new_blocks + num_free_hits

        # Hash before changing anything, so that bad token ids leave every state untouched.
        known_hashes = state.block_hashes if state is not None else computed_hashes
        request_extras = state.extras if state is not None else extras
        new_full_blocks = []
        if self.enable_caching:
            num_cacheable = num_total_computed + (0 if delay_cache_blocks else num_new_tokens)
            num_full_blocks = min(len(token_ids), num_cacheable) // size
            new_full_blocks = self._hash_new_full_blocks(
                token_ids, known_hashes, num_full_blocks, request_extras
            )

        if state is None:
            state = self._new_request_state(extras)
            self._requests[request_id] = state
        if hit_blocks:
            self.block_pool.touch(hit_blocks)
            state.blocks.extend(hit_blocks)
            state.block_ids.extend(computed.block_ids)
            state.block_hashes.extend(computed_hashes)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        state.blocks.extend(new_blocks)
        new_block_ids = [block.block_id for block in new_blocks]
        state.block_ids.extend(new_block_ids)
        state.capacity = len(state.blocks) * size
        if num_partial:
            source, target = computed.partial_block.block_id, state.block_ids[len(hit_blocks)]
            if source != target:  # handed out again as this very block: its KV is in place
                self._block_copies.append((source, target))
        if self.enable_caching:
            self._cache_full_blocks(state, new_full_blocks)
        return new_block_ids

    def _new_request_state(self, extras: BlockHashExtras | None) -> _RequestBlocks:
        return _RequestBlocks(extras, self._first_hash_boundary)

    def _hash_new_full_blocks(
        self,
        token_ids: Sequence[int],
        known_hashes: Sequence[bytes],
        num_full_blocks: int,
        extras: BlockHashExtras | None,
    ) -> list[tuple[bytes, Sequence[int], tuple]]:
        """(hash, token ids, extra keys) of each full block past the ``known_hashes``."""
        size = self.block_size
        first = len(known_hashes)
        hashes = self.hasher.chain(
            token_ids,
            num_full_blocks - first,
            first_block=first,
            parent_hash=known_hashes[-1] if known_hashes else None,
            extras=extras,
        )
        return [
            (
                block_hash,
                token_ids[index * size : (index + 1) * size],
                extras.block_extra_keys(index, size) if extras is not None else (),
            )
            for index, block_hash in enumerate(hashes, first)
        ]

    def _cache_full_blocks(
        self, state: _RequestBlocks, new_full_blocks: list[tuple[bytes, Sequence[int], tuple]]
    ) -> None:
        hashes = state.block_hashes
        cache_full_block = self.block_pool.cache_full_block
        for block_hash, tokens, keys in new_full_blocks:
            index = len(hashes)
            parent = hashes[-1] if index else None
            block = state.blocks[index]
            hashes.append(block_hash)
            if block.is_null:  # a block that already left a sliding window
                continue
            cache_full_block(block, block_hash, parent, tokens, keys, self.kv_group)
            if self.reuse_partial_blocks and block.block_hash == block_hash:
                # Also findable by its first tokens (a prompt asked again after an answer that
                # filled the block), once this step's forward has written it.
                self._blocks_cached_this_step.add(block.block_id)
                partial = PartialBlock(parent or self.hasher.root_hash, keys, tuple(tokens))
                self.block_pool.index_block_tokens(block, partial)
        state.hash_boundary = (len(hashes) + 1) * self.block_size

    def free(
        self,
        request_id: str,
        token_ids: Sequence[int] | None = None,
        num_computed_tokens: int = 0,
    ) -> None:
        """Release a request's blocks, last block first, so that its tail is evicted first.

        With ``reuse_partial_blocks``, ``token_ids`` (the request's tokens) and
        ``num_computed_tokens`` (how many of them have their KV written) index its last, partly
        filled block for later requests that start the same way.
        """
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(
                f"cannot free unknown request {request_id!r} (never allocated or already freed)"
            )
        if token_ids is not None and not 0 <= num_computed_tokens <= min(
            len(token_ids), state.capacity
        ):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens!r} must be in [0, "
                f"{min(len(token_ids), state.capacity)}] for request {request_id!r}"
            )
        del self._requests[request_id]
        if token_ids is not None and self.reuse_partial_blocks:
            self._cache_partial_tail(state, token_ids, num_computed_tokens)
        self.block_pool.free_blocks(state.blocks[::-1])

    def _cache_partial_tail(
        self, state: _RequestBlocks, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        size = self.block_size
        index = len(state.block_hashes)
        start = index * size
        if not 0 < num_computed_tokens - start < size or index >= len(state.blocks):
            return
        block = state.blocks[index]
        if block.ref_cnt != 1 or block.block_hash is not None or block.partial is not None:
            return
        parent = state.block_hashes[-1] if index else self.hasher.root_hash
        keys = state.extras.block_extra_keys(index, size) if state.extras is not None else ()
        tokens = tuple(int(t) for t in token_ids[start:num_computed_tokens])
        self.block_pool.cache_partial_block(block, PartialBlock(parent, keys, tokens))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """``(source, target)`` block ids whose KV to copy, all layers, every slot, since the
        last call; run them before the next forward writes any KV (``reuse_partial_blocks``)."""
        copies = self._block_copies
        self._block_copies = []
        self._blocks_cached_this_step.clear()
        return copies

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table."""
        return list(self._get_state(request_id).block_ids)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """How many leading blocks of ``request_id`` every one of the ``num_running_requests``
        running requests shares (their reference count equals that number)."""
        num_common = 0
        for block in self._get_state(request_id).blocks:
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common

    def _get_state(self, request_id: str) -> _RequestBlocks:
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"unknown request {request_id!r}")
        return state

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; returns ``False`` (and does nothing) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The statistics since the last call; the counters start again from zero."""
        stats = self._stats
        self._stats = PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (empty unless ``enable_kv_events``)."""
        return self.block_pool.take_events()
