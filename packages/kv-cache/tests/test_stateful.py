"""Hypothesis state machine: random lookups, allocations, frees and resets across many requests,
checking the pool's bookkeeping against a simple model after every step, and what a KV cache
run by these block tables would hold (each rule is one engine step: the manager's block copies,
then the KV of the step's tokens)."""

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import event, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from ember_kv_cache import (
    BlockHashExtras,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    MultiModalItem,
)

BLOCK = 2
NUM_BLOCKS = 12
PREFIXES = [(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7), (9, 8, 9, 8)]
EXTRAS = [
    None,
    BlockHashExtras(lora_name="adapter"),
    BlockHashExtras(cache_salt="tenant"),
    BlockHashExtras(mm_items=(MultiModalItem("img", 1, 3),)),
]


class _Request:
    def __init__(self, tokens: list[int], extras: BlockHashExtras | None) -> None:
        self.tokens = tokens
        self.extras = extras
        self.num_computed_tokens = 0


class KVCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    hash_algo = "sha256"
    reuse_partial_blocks = False

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(
            NUM_BLOCKS,
            BLOCK,
            hash_algo=self.hash_algo,
            enable_kv_events=True,
            reuse_partial_blocks=self.reuse_partial_blocks,
        )
        # (block id, slot) -> what the KV there was computed from: the tokens up to and
        # including its position, and the request's extras.
        self.kv: dict[tuple[int, int], tuple[tuple[int, ...], BlockHashExtras | None]] = {}
        self.model: dict[str, _Request] = {}
        # block id -> (token ids up to the end of that block, extras), recorded when written.
        self.content: dict[int, tuple[tuple[int, ...], BlockHashExtras | None]] = {}
        self.next_id = 0

    def _snapshot(self):
        pool = self.mgr.block_pool
        return (
            [block.block_id for block in pool.free_block_queue],
            [block.ref_cnt for block in pool.blocks],
            [block.block_hash for block in pool.blocks],
            {h: block.block_id for h, block in pool.cached_block_hash_to_block.items()},
            {rid: self.mgr.get_block_ids(rid) for rid in self.model},
        )

    def _record_content(self, rid: str) -> None:
        request = self.model[rid]
        for index, block_id in enumerate(self.mgr.get_block_ids(rid)):
            end = (index + 1) * BLOCK
            if end > request.num_computed_tokens:
                break
            self.content[block_id] = (tuple(request.tokens[:end]), request.extras)

    def _allocate(self, rid, request, num_new, lookahead, computed=None) -> bool:
        table_before = self.mgr.get_block_ids(rid) if rid in self.model else []
        before = self._snapshot()
        new_ids = self.mgr.allocate_slots(
            rid,
            request.tokens,
            num_new,
            num_computed_tokens=request.num_computed_tokens,
            computed=computed,
            num_lookahead_tokens=lookahead,
            extras=request.extras,
        )
        if new_ids is None:
            assert self._snapshot() == before, "a refused allocation changed state"
            event("allocation refused")
            return False
        hit_ids = computed.block_ids if computed is not None else []
        assert self.mgr.get_block_ids(rid) == table_before + hit_ids + new_ids
        self.model[rid] = request
        start = request.num_computed_tokens + (computed.num_computed_tokens if computed else 0)
        self._run_step(rid, request, start, start + num_new)
        request.num_computed_tokens = start + num_new
        if request.num_computed_tokens == len(request.tokens):
            request.tokens.append(len(request.tokens) % 5)  # the token sampled this step
        self._record_content(rid)
        return True

    def _run_step(self, rid: str, request: _Request, start: int, end: int) -> None:
        """The step's block copies, then the KV of positions [start, end)."""
        for source, target in self.mgr.take_block_copies():
            event("block copy")
            for slot in range(BLOCK):
                if (source, slot) in self.kv:
                    self.kv[target, slot] = self.kv[source, slot]
        table = self.mgr.get_block_ids(rid)
        for position in range(start, end):
            self.kv[table[position // BLOCK], position % BLOCK] = (
                tuple(request.tokens[: position + 1]),
                request.extras,
            )

    @rule(
        target=requests,
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 4), min_size=1, max_size=9),
        extras=st.sampled_from(EXTRAS),
        chunk=st.integers(1, 12),
        lookahead=st.integers(0, 3),
    )
    def add_request(self, prefix, suffix, extras, chunk, lookahead):
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = [*prefix, *suffix]
        hit = self.mgr.get_computed_blocks(rid, tokens, extras)
        assert (
            hit.num_computed_tokens
            == len(hit.block_ids) * BLOCK + hit.num_partial_tokens
            < len(tokens)
        )
        for index, block_id in enumerate(hit.block_ids):
            assert self.content[block_id] == (tuple(tokens[: (index + 1) * BLOCK]), extras)
        if hit.block_ids:
            event("prefix hit")
        num_new = min(chunk, len(tokens) - hit.num_computed_tokens)
        request = _Request(tokens, extras)
        if not self._allocate(rid, request, num_new, lookahead, computed=hit):
            return multiple()
        return rid

    @rule(rid=requests, chunk=st.integers(1, 6), lookahead=st.integers(0, 3))
    def step(self, rid, chunk, lookahead):
        if rid not in self.model:
            return
        request = self.model[rid]
        num_new = min(chunk, len(request.tokens) - request.num_computed_tokens)
        self._allocate(rid, request, num_new, lookahead)

    @rule(rid=consumes(requests))
    def free(self, rid):
        if rid in self.model:
            request = self.model.pop(rid)
            self.mgr.free(rid, request.tokens, request.num_computed_tokens)

    @rule()
    def lookup_only(self):
        self.mgr.get_computed_blocks("probe", [1, 2, 3, 4, 5, 6, 7, 0])

    @rule()
    def reset_prefix_cache(self):
        in_use = any(block.ref_cnt for block in self.mgr.block_pool.blocks)
        assert self.mgr.reset_prefix_cache() is (not in_use)
        if not in_use:
            assert self.mgr.block_pool.cached_block_hash_to_block == {}

    @precondition(lambda self: self.model)
    @rule()
    def free_all(self):
        for rid in list(self.model):
            self.mgr.free(rid)
            del self.model[rid]
        assert self.mgr.num_free_blocks == NUM_BLOCKS - 1
        assert self.mgr.usage == 0.0

    @invariant()
    def free_plus_in_use_is_total(self):
        pool = self.mgr.block_pool
        in_use = sum(1 for block in pool.blocks[1:] if block.ref_cnt > 0)
        assert self.mgr.num_free_blocks + in_use == NUM_BLOCKS - 1

    @invariant()
    def free_blocks_are_unreferenced(self):
        free_ids = [block.block_id for block in self.mgr.block_pool.free_block_queue]
        assert len(free_ids) == len(set(free_ids)) == self.mgr.num_free_blocks
        assert 0 not in free_ids
        assert all(self.mgr.block_pool.blocks[i].ref_cnt == 0 for i in free_ids)

    @invariant()
    def ref_counts_match_block_tables(self):
        table_refs = Counter(b for rid in self.model for b in self.mgr.get_block_ids(rid))
        pool_refs = {b.block_id: b.ref_cnt for b in self.mgr.block_pool.blocks if b.ref_cnt}
        assert table_refs == pool_refs

    @invariant()
    def cached_hashes_match_recorded_tokens(self):
        hasher = self.mgr.hasher
        for block_hash, block in self.mgr.block_pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
            tokens, extras = self.content[block.block_id]
            assert hasher.hash_prefix(tokens, extras)[-1] == block_hash

    @invariant()
    def stored_events_hash_their_tokens(self):
        hasher = self.mgr.hasher
        for kv_event in self.mgr.take_events():
            if isinstance(kv_event, BlockStored):
                parent = kv_event.parent_block_hash or hasher.root_hash
                expected = hasher.hash_block(parent, kv_event.token_ids, kv_event.extra_keys)
                assert expected == kv_event.block_hash
            elif isinstance(kv_event, BlockRemoved):
                event("eviction")

    @invariant()
    def kv_of_every_request_was_computed_from_its_tokens(self):
        for rid, request in self.model.items():
            table = self.mgr.get_block_ids(rid)
            for position in range(request.num_computed_tokens):
                expected = (tuple(request.tokens[: position + 1]), request.extras)
                assert self.kv[table[position // BLOCK], position % BLOCK] == expected

    @invariant()
    def blocks_cover_tokens(self):
        for rid, request in self.model.items():
            assert len(self.mgr.get_block_ids(rid)) * BLOCK >= request.num_computed_tokens

    @invariant()
    def stats_are_consistent(self):
        stats = self.mgr.take_prefix_cache_stats()
        assert 0 <= stats.hits <= stats.queries

    def teardown(self):
        for rid in list(self.model):
            self.mgr.free(rid)
        assert self.mgr.num_free_blocks == NUM_BLOCKS - 1
        assert all(block.ref_cnt == 0 for block in self.mgr.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


class PartialBlocksKVCacheMachine(KVCacheMachine):
    """The same machine with prefix hits inside a block (copies of partly matching blocks)."""

    reuse_partial_blocks = True


PartialBlocksKVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
TestPartialBlocksKVCacheMachine = PartialBlocksKVCacheMachine.TestCase


class XXHashKVCacheMachine(KVCacheMachine):
    """The same machine over xxhash64 block hashes, for a longer sweep."""

    hash_algo = "xxhash64"


XXHashKVCacheMachine.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=80, deadline=None
)
TestKVCacheMachineLongSweep = pytest.mark.slow(XXHashKVCacheMachine.TestCase)
