"""One KV cache manager over several layer groups (full, sliding window, chunked local, state)
that share one block pool, each group with its own block table per request."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from ember_kv_cache.block_pool import BlockPool
from ember_kv_cache.computed_blocks import ComputedBlocks
from ember_kv_cache.events import KVCacheEvent
from ember_kv_cache.hashing import DEFAULT_HASH_ALGO, BlockHasher, BlockHashExtras
from ember_kv_cache.manager import KVCacheManager
from ember_kv_cache.spec_managers import (
    LocalAttentionManager,
    StateManager,
    blocks_needed,
    longest_hit,
)
from ember_kv_cache.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    StateSpec,
    max_tokens_per_request,
)
from ember_kv_cache.stats import PrefixCacheStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridComputedBlocks:
    """A prefix hit every group can continue from: one ``ComputedBlocks`` per group, all of
    ``num_computed_tokens`` tokens."""

    groups: tuple[ComputedBlocks, ...]
    num_computed_tokens: int

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        return tuple(group.block_ids for group in self.groups)


class HybridKVCacheManager:
    """Paged KV memory for models whose layers keep different things (``specs``: one per group,
    see ``ember_kv_cache.specs.group_layers``), over one pool of ``num_blocks`` blocks.

    The calls are ``KVCacheManager``'s, with a block table per group: ``allocate_slots`` returns
    one list of new block ids per group (or None, nothing allocated in any group),
    ``get_block_ids`` one table per group. A block id means the same place in every layer's
    cache tensor, so the engine gives each layer's attention its group's table.

    Group ``g > 0`` hashes its blocks under the seed ``hash_seed + b"/group/g"``: the groups'
    blocks of the same tokens hold different layers' KV, so their cache keys must differ (group
    0 hashes as a plain ``KVCacheManager``). A prefix hit is the longest that every group can
    continue from (a local group needs only its window's tail, a state group none: with one, hits
    are off). ``reuse_partial_blocks`` is for full attention alone; a KV connector moves each
    group's blocks by ``get_group_block_ids`` (not with a state group).

    With ``interleave_block_ids`` the tables come as one list for an engine that stores one
    block-table row per request: first the one block of each state group (in group order), then
    the token-block groups' tables interleaved, ``[g0[0], g1[0], ..., g0[1], g1[1], ...]``: with
    ``S`` state groups, token group ``g``'s table is the row's entries ``S + g::num_token_groups``.
    New ids append to the row as for a single group (a state block comes with a request's first
    allocation only).

    A state group summarizes every token before it, so with one prefix caching is off: the
    manager says so once in the log when ``enable_caching`` asked for it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        specs: Sequence[KVCacheSpec],
        *,
        enable_caching: bool = True,
        hash_algo: str = DEFAULT_HASH_ALGO,
        hash_seed: bytes = b"",
        enable_kv_events: bool = False,
        interleave_block_ids: bool = False,
    ) -> None:
        if not specs:
            raise ValueError("specs must name at least one layer group")
        self.block_pool = BlockPool(
            num_blocks, enable_caching=enable_caching, enable_kv_events=enable_kv_events
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.specs = tuple(specs)
        has_state = any(isinstance(s, StateSpec) for s in specs)
        if enable_caching and has_state:
            logger.info(
                "prefix caching is off for this model: its state layers (Mamba / linear "
                "attention) keep a state per request that a cached block cannot restore"
            )
        self.enable_caching = enable_caching and not has_state
        self.groups = []
        for index, spec in enumerate(self.specs):
            settings = dict(
                enable_caching=self.enable_caching,
                hash_algo=hash_algo,
                hash_seed=hash_seed + (f"/group/{index}".encode() if index else b""),
                block_pool=self.block_pool,
            )
            if isinstance(spec, FullAttentionSpec):
                group = KVCacheManager(num_blocks, block_size, **settings)
            elif isinstance(spec, StateSpec):
                group = StateManager(num_blocks, block_size, spec, block_pool=self.block_pool)
            else:
                group = LocalAttentionManager(num_blocks, block_size, spec, **settings)
            group.kv_group = index
            self.groups.append(group)
        # Group 0's hasher (the one a plain manager would have), also where caching is off: an
        # engine reports its algorithm either way.
        self.hasher: BlockHasher = getattr(self.groups[0], "hasher", None) or BlockHasher(
            block_size, hash_algo, hash_seed
        )
        self.interleave_block_ids = interleave_block_ids
        self._state_first = sorted(
            range(len(self.specs)), key=lambda g: not isinstance(self.specs[g], StateSpec)
        )  # the row's group order: state groups, then token groups (stable)
        self.num_state_groups = sum(isinstance(s, StateSpec) for s in self.specs)
        self._stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def max_tokens_per_request(self, max_new_tokens: int) -> int | None:
        """The longest request the pool always serves alone, a step adding at most
        ``max_new_tokens`` tokens (None: any length)."""
        return max_tokens_per_request(
            self.specs, self.num_blocks - 1, self.block_size, max_new_tokens
        )

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], extras: BlockHashExtras | None = None
    ) -> HybridComputedBlocks:
        """The longest cached prefix, in whole blocks, that every group can continue from,
        leaving at least one token to compute."""
        if extras is not None and not isinstance(extras, BlockHashExtras):
            raise ValueError(f"extras must be a BlockHashExtras or None, got {extras!r}")
        empty = HybridComputedBlocks(tuple(ComputedBlocks([], 0) for _ in self.groups), 0)
        if not self.enable_caching:
            return empty
        num_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        hashes = [list(g.hasher.chain(token_ids, num_blocks, extras=extras)) for g in self.groups]
        # Shrink the hit until every group can continue from it: a full group's hit is any
        # prefix of its longest, a local group's must end where its tail is cached.
        limit = num_blocks
        while True:
            found = [self._hit(g, h, limit) for g, h in zip(self.groups, hashes)]
            shortest = min(found)
            if shortest == limit:
                break
            limit = shortest
        result = HybridComputedBlocks(
            tuple(self._computed(g, h, limit, extras) for g, h in zip(self.groups, hashes)),
            limit * self.block_size,
        )
        self._stats.record(len(token_ids), result.num_computed_tokens)
        return result

    def _computed(self, group, hashes: list[bytes], num_blocks: int, extras) -> ComputedBlocks:
        if not isinstance(group, KVCacheManager) or isinstance(group, LocalAttentionManager):
            return group.computed_from_hashes(hashes, num_blocks, extras)
        cached = self.block_pool.cached_block_hash_to_block
        blocks = tuple(cached[h] for h in hashes[:num_blocks])
        return ComputedBlocks(
            [b.block_id for b in blocks],
            num_blocks * self.block_size,
            blocks,
            tuple(hashes[:num_blocks]),
            extras,
        )

    def _hit(self, group, hashes: list[bytes], limit: int) -> int:
        cached = self.block_pool.cached_block_hash_to_block
        if isinstance(group, LocalAttentionManager):
            return longest_hit(hashes[:limit], cached, group._num_skipped_blocks)
        if isinstance(group, StateManager):
            return 0
        return longest_hit(hashes[:limit], cached, lambda n: 0)

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        computed: HybridComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        extras: BlockHashExtras | None = None,
        delay_cache_blocks: bool = False,
    ) -> tuple[list[int], ...] | None:
        """``KVCacheManager.allocate_slots`` in every group: the new block ids per group, or
        None when the pool cannot serve them all (nothing allocated; blocks that left a window
        are freed either way)."""
        per_group = [None] * len(self.groups)
        if computed is not None:
            if not isinstance(computed, HybridComputedBlocks):
                raise ValueError("computed must come from HybridKVCacheManager.get_computed_blocks")
            per_group = list(computed.groups)
        needed = 0
        for group, hit in zip(self.groups, per_group):
            need = (getattr(group, "blocks_needed", None) or partial(blocks_needed, group))(
                request_id,
                token_ids,
                num_new_tokens,
                num_computed_tokens=num_computed_tokens,
                computed=hit,
                num_lookahead_tokens=num_lookahead_tokens,
                extras=extras,
            )
            if need is None:
                return None
            needed += need
        if needed > self.block_pool.num_free_blocks:
            return None
        # Take every group's hits off the free queue first: one group's new blocks must not
        # evict a free cached block another group's hit is about to take.
        held = [b for hit in per_group if hit is not None for b in hit.blocks if not b.is_null]
        self.block_pool.touch(held)
        new_ids = tuple(
            group.allocate_slots(
                request_id,
                token_ids,
                num_new_tokens,
                num_computed_tokens=num_computed_tokens,
                computed=hit,
                num_lookahead_tokens=num_lookahead_tokens,
                extras=extras,
                delay_cache_blocks=delay_cache_blocks,
            )
            for group, hit in zip(self.groups, per_group)
        )
        self.block_pool.free_blocks(held)  # each group took its own reference meanwhile
        return self._row(new_ids) if self.interleave_block_ids else new_ids

    def free(
        self, request_id: str, token_ids: Sequence[int] | None = None, num_computed_tokens: int = 0
    ) -> None:
        """Release the request's blocks in every group."""
        for group in self.groups:
            group.free(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """A copy of the request's block table in each group (interleaved into one list with
        ``interleave_block_ids``)."""
        tables = tuple(group.get_block_ids(request_id) for group in self.groups)
        return self._row(tables) if self.interleave_block_ids else tables

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """A copy of the request's block table in each group, never interleaved."""
        return tuple(group.get_block_ids(request_id) for group in self.groups)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        return 0

    def take_block_copies(self) -> list[tuple[int, int]]:
        return []

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats = self._stats
        self._stats = PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def _row(self, tables: tuple[list[int], ...]) -> list[int]:
        """The groups' new ids (or tables) as one block-table row's entries: state groups'
        ids first, then the token groups' interleaved."""
        ordered = [tables[g] for g in self._state_first]
        states = self.num_state_groups
        return [i for ids in ordered[:states] for i in ids] + _interleave(tuple(ordered[states:]))


def _interleave(tables: tuple[list[int], ...]) -> list[int]:
    """Groups' equally long id lists as one: entry ``i`` of group ``g`` at ``i * len + g``."""
    if not tables or not tables[0]:
        return []
    return [block_id for entries in zip(*tables, strict=True) for block_id in entries]
