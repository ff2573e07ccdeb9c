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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ember_kv_cache.hashing import BlockHasher, BlockHashExtras
from ember_kv_cache.tier_entry import LayoutFingerprint
from ember_kv_cache.tier_store import TieredKVStore, TierStats
from ember_kv_cache.tiers import check_tier_spec, make_tier

KV_CONNECTORS = ("TieredConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """``kv_transfer_config`` as vLLM spells it: ``{"kv_connector": "TieredConnector",
    "kv_role": "kv_both", "kv_connector_extra_config": {"chunk_size": 256, "tiers": [...]}}``.

    A ``kv_producer`` saves the KV it computes, a ``kv_consumer`` loads what it finds, and
    ``kv_both`` does both. ``chunk_size`` (tokens, a multiple of the block size) is the unit of
    storage; ``tiers`` are tier configurations in lookup order (see ``make_tier``).
    """

    kv_connector: str
    kv_role: str
    chunk_size: int
    tiers: tuple[dict, ...]

    @classmethod
    def from_dict(cls, config: dict) -> KVTransferConfig:
        """Validate ``config``; a ValueError names the field that is wrong."""
        if not isinstance(config, dict):
            raise ValueError(f"kv_transfer_config must be a dict, got {type(config).__name__}")
        unknown = set(config) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}")
        connector = config.get("kv_connector")
        if connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector must be one of {KV_CONNECTORS}, got {connector!r}"
            )
        role = config.get("kv_role")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {role!r}")
        extra = config.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict")
        unknown = set(extra) - {"chunk_size", "tiers"}
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")
        chunk_size = extra.get("chunk_size", 256)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(
                f"kv_connector_extra_config.chunk_size must be a positive int, got {chunk_size!r}"
            )
        tiers = extra.get("tiers")
        if not isinstance(tiers, list) or not tiers:
            raise ValueError("kv_connector_extra_config.tiers must be a non-empty list of tiers")
        for tier in tiers:
            check_tier_spec(tier)
        return cls(connector, role, chunk_size, tuple(dict(t) for t in tiers))

    def as_dict(self) -> dict:
        """The dict ``from_dict`` reads back (to hand the config to another process)."""
        return {
            "kv_connector": self.kv_connector,
            "kv_role": self.kv_role,
            "kv_connector_extra_config": {
                "chunk_size": self.chunk_size,
                "tiers": [dict(tier) for tier in self.tiers],
            },
        }

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def make_store(self, fingerprint: LayoutFingerprint) -> TieredKVStore:
        if fingerprint.chunk_size != self.chunk_size:
            raise ValueError("the fingerprint's chunk_size differs from the config's")
        return TieredKVStore([make_tier(spec) for spec in self.tiers], fingerprint)


@dataclass
class ChunkTransfer:
    """Chunks of one request to move between its blocks and the store.

    Chunk ``first_chunk + i`` covers tokens ``[(first_chunk + i) * chunk_size, ...)`` and is
    stored under ``chunk_hashes[i]``; ``block_ids`` is the request's block table. A load skips
    the first ``skip_tokens`` tokens of its first chunk (already in the request's blocks). With
    ``partial_blocks``, the last chunk is a partial one: a save stores that many blocks of it, a
    load uses that many blocks of the stored entry (which may hold more).
    """

    request_id: str
    first_chunk: int
    chunk_hashes: list[bytes]
    block_ids: list[int]
    skip_tokens: int = 0
    partial_blocks: int = 0


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
    """

    def __init__(self, config: KVTransferConfig, store: TieredKVStore, hasher: BlockHasher) -> None:
        if config.chunk_size % hasher.block_size:
            raise ValueError(
                f"kv_connector_extra_config.chunk_size ({config.chunk_size}) must be a multiple "
                f"of the block size ({hasher.block_size})"
            )
        self.config = config
        self.store = store
        self.hasher = hasher
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
        Starts the request's connector state."""
        state = _RequestChunks(extras, num_computed_tokens // self.chunk_size)
        self._requests[request_id] = state
        if not self.config.is_consumer:
            return 0, False
        size = self.chunk_size
        first = num_computed_tokens // size
        hashes = []
        for index in range(first, (len(token_ids) - 1) // size):
            chunk_hash = self._chunk_hash(state, token_ids, index)
            if not self.store.contains(chunk_hash):
                break
            hashes.append(chunk_hash)
        end_chunk = first + len(hashes)
        partial_hash, partial_blocks = self._find_partial(state, token_ids, end_chunk)
        if partial_blocks:
            hashes.append(partial_hash)
        matched_end = end_chunk * size + partial_blocks * self.hasher.block_size
        num_matched = max(0, matched_end - num_computed_tokens)
        self._stats.lookup_tokens += len(token_ids) - num_computed_tokens
        self._stats.matched_tokens += num_matched
        if num_matched:
            skip = num_computed_tokens - first * size
            state.pending_load = (first, hashes, skip, partial_blocks)
        return num_matched, num_matched > 0

    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """The request now holds ``block_ids``; with external tokens, queue their load."""
        state = self._requests[request_id]
        if num_external_tokens and state.pending_load is not None:
            first, hashes, skip, partial_blocks = state.pending_load
            self._loads.append(
                ChunkTransfer(request_id, first, hashes, list(block_ids), skip, partial_blocks)
            )
            state.next_save_chunk = first + len(hashes) - (partial_blocks > 0)
        state.pending_load = None

    def build_connector_meta(
        self,
        scheduled: Iterable[tuple[str, Sequence[int], int]],
        block_ids_of: Callable[[str], Sequence[int]],
    ) -> KVConnectorMetadata:
        """This step's metadata: the loads queued since the last step, and saves of the chunks
        that ``scheduled`` completes. Each entry is ``(request_id, token_ids,
        num_computed_tokens after this step)``; ``block_ids_of`` gives a request's block table."""
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
            meta.saves.append(
                ChunkTransfer(request_id, first, hashes, list(block_ids_of(request_id)))
            )
            state.next_save_chunk = end
        return meta

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
        block_ids: Sequence[int] = (),
    ) -> tuple[bool, dict | None]:
        """Forget the request (a fetched load not yet written is dropped). Given its prompt
        (``token_ids``), computed tokens and blocks (a request that ended normally), a producer
        saves the whole blocks of the prompt's last, partial chunk, unless stored already: the
        key a later identical or longer prompt looks up. Returns (delay freeing its blocks until
        the worker reports that save in ``finished_saving``, transfer params)."""
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
        if self.store.contains(key):
            return False, None
        self._finish_saves.append(
            ChunkTransfer(request_id, index, [key], list(block_ids), partial_blocks=partial_blocks)
        )
        return True, None

    def record_loaded(self, num_tokens: int) -> None:
        self._stats.loaded_tokens += num_tokens

    def take_stats(self) -> KVConnectorStats:
        stats = self._stats
        stats.tiers = self.store.take_stats()
        self._stats = KVConnectorStats()
        return stats

    def _find_partial(
        self, state: _RequestChunks, token_ids: Sequence[int], index: int
    ) -> tuple[bytes, int]:
        """The key of the longest stored partial chunk ``index`` that the prompt's whole blocks
        name, and how many of its blocks the prompt can take (leaving one token to compute);
        ``(b"", 0)`` when there is none."""
        first_block = index * self._blocks_per_chunk
        block_size = self.hasher.block_size
        usable = (len(token_ids) - 1) // block_size - first_block
        if usable <= 0:
            return b"", 0
        longest = min(self._blocks_per_chunk - 1, len(token_ids) // block_size - first_block)
        keys = [
            self._block_hash(state, token_ids, first_block + n - 1) for n in range(1, longest + 1)
        ]
        found = self.store.contains_many(keys)  # one round trip, not one per candidate
        for num_blocks in range(longest, 0, -1):
            if found[num_blocks - 1]:
                return keys[num_blocks - 1], min(num_blocks, usable)
        return b"", 0

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
