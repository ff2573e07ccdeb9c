"""The tiered KV connector's configuration and its engine-neutral scheduler side.

Split as vLLM v1's KV connector API: the scheduler side (this module) decides, per request and
step, which chunks to load from the tier store and which to save, and hands that to the worker
as ``KVConnectorMetadata``; the worker side (in the engine, which owns the KV tensors) moves the
bytes and reports back a ``KVConnectorOutput``. It speaks in request ids, token ids and block
ids, like ``KVCacheManager``.

Loads run in two parts. The fetch is asynchronous: a request whose chunks are found waits (in the
engine's own status) while the worker reads and checks them, and its fetched tokens count as
computed once the worker reports them. The write into its blocks then runs inside the next step's
forward, layer by layer (each attention layer waits for its own), so no forward reads a block
before it is written. Saves are of whole computed chunks, in the step that completes them; when
a request finishes, the whole blocks of its last, partial chunk are saved too (its blocks are
freed once the worker reports that save), keyed by the chain hash of their last block, and a
lookup tries that partial key where the whole chunks stop.

A model with several layer groups (or one sliding-window group) stores one entry per group and
chunk, moved by that group's own block table (``group_chunks``): a local group saves the blocks
it still holds and a hit needs only its window's tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ember_kv_cache.group_chunks import check_connector_specs, group_chunk_hash, group_hit_holds
from ember_kv_cache.hashing import BlockHasher, BlockHashExtras
from ember_kv_cache.specs import KVCacheSpec
from ember_kv_cache.tier_store import TieredKVStore, TierStats
from ember_kv_cache.transfer_config import KV_CONNECTORS, KV_ROLES, KVTransferConfig  # noqa: F401 (re-exported)


@dataclass
class ChunkTransfer:
    """Chunks of one request to move between its blocks and the store.

    Chunk ``first_chunk + i`` covers tokens ``[(first_chunk + i) * chunk_size, ...)`` and is
    stored under ``chunk_hashes[i]`` (``b""``: not moved); ``block_ids`` is the block table of
    the request's KV group ``group``. A load skips the first ``skip_tokens`` tokens of its first
    chunk (already in the request's blocks), a save those of its chunk (they left the group's
    window: the entry holds the chunk's tail). With ``partial_blocks``, the last chunk is a
    partial one: a save stores that many blocks of it, a load uses that many blocks of the stored
    entry, which covers the chunk's first ``stored_blocks``.
    """

    request_id: str
    first_chunk: int
    chunk_hashes: list[bytes]
    block_ids: list[int]
    skip_tokens: int = 0
    partial_blocks: int = 0
    group: int = 0
    stored_blocks: int = 0


@dataclass
class KVConnectorMetadata:
    """One step's transfers, from the scheduler side to the worker side: fetches to start,
    fetched requests to write into their blocks during this step's forward (or drop, when the
    request ended meanwhile), and chunks to save."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """What the worker side finished: for each request whose fetch ended, how many of its
    tokens it holds ready to write (less than asked where a chunk was missing or damaged); and
    the finished requests whose last partial chunk is saved (their blocks may be freed)."""

    finished_loading: dict[str, int] = field(default_factory=dict)
    finished_saving: list[str] = field(default_factory=list)


@dataclass
class KVConnectorStats:
    """Lookups since the last ``take_stats()`` (in tokens) and each tier's ``TierStats``."""

    lookup_tokens: int = 0
    matched_tokens: int = 0
    loaded_tokens: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)


class _RequestChunks:
    """A request's block hashes so far (computed on demand) and its next chunk to save."""

    __slots__ = ("block_hashes", "extras", "next_save_chunk", "pending_load")

    def __init__(self, extras: BlockHashExtras | None, next_save_chunk: int) -> None:
        self.block_hashes: list[bytes] = []
        self.extras = extras
        self.next_save_chunk = next_save_chunk
        self.pending_load: tuple[int, list[bytes], int] | None = None


class TieredConnectorScheduler:
    """The scheduler side of the tiered connector, over a ``TieredKVStore``.

    ``hasher`` must be the engine's prefix-cache hasher (same block size, algorithm and seed):
    chunk keys are its chain hashes, so any engine with the same hasher and layout finds them.
    ``group_specs`` are the KV cache manager's groups (default: one of full attention); block
    tables come as one list per group (a plain list: one group).
    """

    def __init__(
        self,
        config: KVTransferConfig,
        store: TieredKVStore,
        hasher: BlockHasher,
        group_specs: Sequence[KVCacheSpec] = (),
    ) -> None:
        if config.chunk_size % hasher.block_size:
            raise ValueError(
                f"kv_connector_extra_config.chunk_size ({config.chunk_size}) must be a multiple "
                f"of the block size ({hasher.block_size})"
            )
        self.config = config
        self.store = store
        self.hasher = hasher
        self.group_specs = check_connector_specs(group_specs)
        self.chunk_size = config.chunk_size
        self._blocks_per_chunk = config.chunk_size // hasher.block_size
        self._requests: dict[str, _RequestChunks] = {}
        self._loads: list[ChunkTransfer] = []
        self._writes: list[str] = []
        self._discards: list[str] = []
        self._finish_saves: list[ChunkTransfer] = []
        self._stats = KVConnectorStats()

    def get_num_new_matched_tokens(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        extras: BlockHashExtras | None = None,
    ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (the local prefix hit) that the store can
        provide, in whole chunks and then the whole blocks of one partial chunk, leaving at
        least one token to compute, and whether they load asynchronously (always, here).
        Every group must hold what its next query reads there (a local group: its window's
        tail). Starts the request's connector state."""
        state = _RequestChunks(extras, num_computed_tokens // self.chunk_size)
        self._requests[request_id] = state
        if not self.config.is_consumer:
            return 0, False
        size, per_chunk = self.chunk_size, self._blocks_per_chunk
        num_groups = len(self.group_specs)
        first = num_computed_tokens // size
        local_blocks = num_computed_tokens // self.hasher.block_size
        last = max(first, (len(token_ids) - 1) // size)
        hashes = [self._chunk_hash(state, token_ids, i) for i in range(first, last)]
        found = self.store.contains_many(
            [group_chunk_hash(h, g) for h in hashes for g in range(num_groups)]
        )
        # Each group's flag per block: its entry of the block's chunk is stored.
        held = np.zeros((num_groups, (last + 1) * per_chunk), dtype=bool)
        if hashes:
            per_group = np.array(found, dtype=bool).reshape(len(hashes), num_groups).T
            held[:, first * per_chunk : last * per_chunk] = per_group.repeat(per_chunk, axis=1)
        end_chunk = first
        for index in range(first + 1, last + 1):
            if self._holds(held, local_blocks, index * per_chunk):
                end_chunk = index
        partial_hash, partial_blocks, stored = self._find_partial(
            state, token_ids, end_chunk, held, local_blocks
        )
        end_block = end_chunk * per_chunk + partial_blocks
        num_matched = max(0, end_block * self.hasher.block_size - num_computed_tokens)
        self._stats.lookup_tokens += len(token_ids) - num_computed_tokens
        self._stats.matched_tokens += num_matched
        if num_matched:
            plans = []
            for group, spec in enumerate(self.group_specs):
                # A local group reads its window's tail only: the chunks before it stay put.
                skipped = spec.num_skipped_tokens(end_block * self.hasher.block_size)
                first_needed = max(local_blocks, skipped // self.hasher.block_size) // per_chunk
                keys = hashes[: end_chunk - first] + ([partial_hash] if partial_blocks else [])
                plans.append(
                    [
                        group_chunk_hash(key, group) if first + i >= first_needed else b""
                        for i, key in enumerate(keys)
                    ]
                )
            skip = num_computed_tokens - first * size
            state.pending_load = (first, plans, skip, partial_blocks, stored)
        return num_matched, num_matched > 0

    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence, num_external_tokens: int
    ) -> None:
        """The request now holds ``block_ids`` (one table per group); with external tokens,
        queue their load."""
        state = self._requests[request_id]
        if num_external_tokens and state.pending_load is not None:
            first, plans, skip, partial_blocks, stored = state.pending_load
            for group, (hashes, table) in enumerate(zip(plans, _tables(block_ids), strict=True)):
                self._loads.append(
                    ChunkTransfer(
                        request_id, first, hashes, list(table), skip, partial_blocks, group, stored
                    )
                )
            state.next_save_chunk = first + len(plans[0]) - (partial_blocks > 0)
        state.pending_load = None

    def build_connector_meta(
        self,
        scheduled: Iterable[tuple[str, Sequence[int], int]],
        block_ids_of: Callable[[str], Sequence],
    ) -> KVConnectorMetadata:
        """This step's metadata: the loads queued since the last step, and saves of the chunks
        that ``scheduled`` completes. Each entry is ``(request_id, token_ids,
        num_computed_tokens after this step)``; ``block_ids_of`` gives a request's block tables
        (one per group)."""
        meta = KVConnectorMetadata(
            loads=self._loads,
            writes=self._writes,
            discards=self._discards,
            saves=self._finish_saves,
        )
        self._loads, self._writes, self._discards, self._finish_saves = [], [], [], []
        if not self.config.is_producer:
            return meta
        size = self.chunk_size
        for request_id, token_ids, num_computed in scheduled:
            state = self._requests.get(request_id)
            if state is None:
                continue
            end = min(num_computed, len(token_ids)) // size
            if end <= state.next_save_chunk:
                continue
            first = state.next_save_chunk
            hashes = [self._chunk_hash(state, token_ids, i) for i in range(first, end)]
            for group, table in enumerate(_tables(block_ids_of(request_id))):
                meta.saves.extend(self._group_saves(request_id, group, first, hashes, table))
            state.next_save_chunk = end
        return meta

    def _group_saves(
        self, request_id: str, group: int, first: int, hashes: list[bytes], table: Sequence[int]
    ) -> list[ChunkTransfer]:
        """Saves of one group's chunks ``first, ...``: a chunk some of whose leading blocks left
        the window (the null block 0 holds their place) alone, with what it still holds; the
        whole ones after it together."""
        per_chunk = self._blocks_per_chunk
        table = list(table)
        saves = []
        index = first
        while index < first + len(hashes):
            blocks = table[index * per_chunk : (index + 1) * per_chunk]
            freed = next((n for n, block_id in enumerate(blocks) if block_id), per_chunk)
            if not freed:
                break
            if freed < per_chunk:
                key = group_chunk_hash(hashes[index - first], group)
                skip = freed * self.hasher.block_size
                saves.append(ChunkTransfer(request_id, index, [key], table, skip, group=group))
            index += 1
        rest = [group_chunk_hash(h, group) for h in hashes[index - first :]]
        if rest:
            saves.append(ChunkTransfer(request_id, index, rest, table, group=group))
        return saves

    def update_connector_output(
        self, output: KVConnectorOutput | None
    ) -> tuple[dict[str, int], list[str]]:
        """The requests whose fetch finished, with the tokens they will have in their blocks
        (their writes go out with the next step's metadata), and the finished requests whose
        last partial chunk is saved."""
        if output is None:
            return {}, []
        self._writes.extend(output.finished_loading)
        return output.finished_loading, output.finished_saving

    def request_finished(
        self,
        request_id: str,
        token_ids: Sequence[int] | None = None,
        num_computed_tokens: int = 0,
        block_ids: Sequence = (),
    ) -> tuple[bool, dict | None]:
        """Forget the request (a fetched load not yet written is dropped). Given its prompt
        (``token_ids``), computed tokens and blocks (a request that ended normally, one table
        per group), a producer saves the whole blocks of the prompt's last, partial chunk,
        unless stored already (or a group no longer holds any of them): the key a later
        identical or longer prompt looks up. Returns (delay freeing its blocks until the worker
        reports that save in ``finished_saving``, transfer params)."""
        state = self._requests.pop(request_id, None)
        if request_id in self._writes:
            self._writes.remove(request_id)
            self._discards.append(request_id)
        if state is None or token_ids is None or not self.config.is_producer:
            return False, None
        num_blocks = min(num_computed_tokens, len(token_ids)) // self.hasher.block_size
        index, partial_blocks = divmod(num_blocks, self._blocks_per_chunk)
        if not partial_blocks:
            return False, None
        key = self._block_hash(state, token_ids, num_blocks - 1)
        groups = range(len(self.group_specs))
        keys = [group_chunk_hash(key, group) for group in groups]
        if all(self.store.contains_many(keys)):
            return False, None
        saves = []
        start = index * self._blocks_per_chunk
        for group, table in zip(groups, _tables(block_ids), strict=True):
            blocks = list(table[start : start + partial_blocks])
            freed = next((n for n, block_id in enumerate(blocks) if block_id), partial_blocks)
            if freed == partial_blocks:
                return False, None  # this group keeps none of them: no hit could use the rest
            skip = freed * self.hasher.block_size
            saves.append(
                ChunkTransfer(
                    request_id,
                    index,
                    [keys[group]],
                    list(table),
                    skip,
                    partial_blocks,
                    group,
                    partial_blocks,
                )
            )
        self._finish_saves.extend(saves)
        return True, None

    def record_loaded(self, num_tokens: int) -> None:
        self._stats.loaded_tokens += num_tokens

    def take_stats(self) -> KVConnectorStats:
        stats = self._stats
        stats.tiers = self.store.take_stats()
        self._stats = KVConnectorStats()
        return stats

    def _holds(self, held: np.ndarray, local_blocks: int, end_block: int) -> bool:
        return group_hit_holds(
            self.group_specs, self.hasher.block_size, held, local_blocks, end_block
        )

    def _find_partial(
        self,
        state: _RequestChunks,
        token_ids: Sequence[int],
        index: int,
        held: np.ndarray,
        local_blocks: int,
    ) -> tuple[bytes, int, int]:
        """The key of the longest partial chunk ``index`` that every group stores, that the
        prompt's whole blocks name and that a hit can end in; how many of its blocks the prompt
        can take (leaving one token to compute) and how many it covers; ``(b"", 0, 0)`` when
        there is none."""
        first_block = index * self._blocks_per_chunk
        block_size = self.hasher.block_size
        usable = (len(token_ids) - 1) // block_size - first_block
        if usable <= 0:
            return b"", 0, 0
        longest = min(self._blocks_per_chunk - 1, len(token_ids) // block_size - first_block)
        keys = [
            self._block_hash(state, token_ids, first_block + n - 1) for n in range(1, longest + 1)
        ]
        num_groups = len(self.group_specs)
        # One round trip, not one per candidate.
        found = self.store.contains_many(
            [group_chunk_hash(key, g) for key in keys for g in range(num_groups)]
        )
        held = held.copy()
        held[:, first_block:] = False
        for num_blocks in range(longest, 0, -1):
            if not all(found[(num_blocks - 1) * num_groups : num_blocks * num_groups]):
                continue
            use = min(num_blocks, usable)
            held[:, first_block : first_block + num_blocks] = True
            if self._holds(held, local_blocks, first_block + use):
                return keys[num_blocks - 1], use, num_blocks
            held[:, first_block:] = False
        return b"", 0, 0

    def _chunk_hash(self, state: _RequestChunks, token_ids: Sequence[int], index: int) -> bytes:
        """The chain hash of chunk ``index``'s last block."""
        return self._block_hash(state, token_ids, (index + 1) * self._blocks_per_chunk - 1)

    def _block_hash(
        self, state: _RequestChunks, token_ids: Sequence[int], last_block: int
    ) -> bytes:
        """The chain hash of block ``last_block``, hashing blocks as far as needed."""
        hashes = state.block_hashes
        size = self.hasher.block_size
        parent = hashes[-1] if hashes else self.hasher.root_hash
        extras = state.extras
        for block in range(len(hashes), last_block + 1):
            keys = extras.block_extra_keys(block, size) if extras is not None else ()
            parent = self.hasher.hash_block(
                parent, token_ids[block * size : (block + 1) * size], keys
            )
            hashes.append(parent)
        return hashes[last_block]


def _tables(block_ids: Sequence) -> tuple[Sequence[int], ...]:
    """Block tables as one per group (a plain list of ids is one group's)."""
    if block_ids and not isinstance(block_ids[0], (list, tuple)):
        return (block_ids,)
    return tuple(block_ids) or ((),)
