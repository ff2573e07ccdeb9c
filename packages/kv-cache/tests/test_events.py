"""KV cache events: stored, removed, cleared; drained by take_events."""

from ember_kv_cache import (
    AllBlocksCleared,
    BlockHashExtras,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
)


def test_stored_events_carry_hash_parent_tokens_and_extra_keys():
    mgr = KVCacheManager(8, 2, enable_kv_events=True)
    extras = BlockHashExtras(lora_name="sql", cache_salt="s")
    mgr.allocate_slots("a", [1, 2, 3, 4, 5], 5, extras=extras)
    events = mgr.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    ids = mgr.get_block_ids("a")
    assert (first.block_id, first.token_ids, first.parent_block_hash) == (ids[0], (1, 2), None)
    assert first.extra_keys == (("lora", "sql"), ("salt", "s"))
    assert second.parent_block_hash == first.block_hash
    assert (second.token_ids, second.extra_keys) == ((3, 4), (("lora", "sql"),))
    assert mgr.block_pool.cached_block_hash_to_block[second.block_hash].block_id == ids[1]
    assert mgr.take_events() == []


def test_removed_and_cleared_events():
    mgr = KVCacheManager(3, 2, enable_kv_events=True)  # two usable blocks
    mgr.allocate_slots("a", [1, 2, 3, 4], 4)
    mgr.free("a")
    stored = mgr.take_events()
    mgr.allocate_slots("b", [7, 7, 7], 3)
    removed = mgr.take_events()
    assert {e.block_hash for e in removed if isinstance(e, BlockRemoved)} == {
        e.block_hash for e in stored
    }
    assert sum(isinstance(e, BlockStored) for e in removed) == 1
    mgr.free("b")
    assert mgr.reset_prefix_cache()
    assert mgr.take_events() == [AllBlocksCleared()]


def test_no_events_unless_enabled():
    mgr = KVCacheManager(8, 2)
    mgr.allocate_slots("a", [1, 2, 3, 4], 4)
    mgr.free("a")
    mgr.reset_prefix_cache()
    assert mgr.take_events() == []
