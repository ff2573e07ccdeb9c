"""KVCacheManager: lookups, allocation, caching, freeing and errors."""

import pytest

from ember_kv_cache import BlockHashExtras, ComputedBlocks, KVCacheManager

BLOCK = 4


def run_prefill(mgr: KVCacheManager, request_id: str, tokens: list[int], **kw) -> ComputedBlocks:
    hit = mgr.get_computed_blocks(request_id, tokens, kw.get("extras"))
    new = mgr.allocate_slots(
        request_id, tokens, len(tokens) - hit.num_computed_tokens, computed=hit, **kw
    )
    assert new is not None
    return hit


def test_prefix_hit_is_whole_blocks_and_never_the_whole_prompt():
    mgr = KVCacheManager(16, BLOCK)
    prompt = list(range(12))  # exactly three blocks
    run_prefill(mgr, "a", prompt)
    mgr.free("a")
    hit = mgr.get_computed_blocks("b", prompt)
    assert hit.num_computed_tokens == 8  # the last block is recomputed: one token must be
    assert len(hit.block_ids) == 2
    longer = mgr.get_computed_blocks("c", [*prompt, 99])
    assert longer.num_computed_tokens == 12
    assert mgr.get_computed_blocks("d", [*prompt[:11], 98, 7]).num_computed_tokens == 8


def test_lookup_takes_no_references_and_allocate_takes_over_the_hit():
    mgr = KVCacheManager(16, BLOCK)
    prompt = list(range(10))
    run_prefill(mgr, "a", prompt)
    mgr.free("a")
    free_before = mgr.num_free_blocks
    hit = mgr.get_computed_blocks("b", prompt)
    assert mgr.num_free_blocks == free_before
    new = mgr.allocate_slots("b", prompt, 2, computed=hit)
    assert len(new) == 1
    assert mgr.get_block_ids("b")[:2] == hit.block_ids
    assert mgr.num_free_blocks == free_before - 3


def test_shared_prefix_blocks_are_shared_between_running_requests():
    mgr = KVCacheManager(16, BLOCK)
    system = list(range(100, 108))
    run_prefill(mgr, "a", [*system, 1, 2])
    hit = run_prefill(mgr, "b", [*system, 3, 4, 5])
    assert hit.num_computed_tokens == 8
    assert mgr.get_block_ids("a")[:2] == mgr.get_block_ids("b")[:2]
    assert mgr.get_num_common_prefix_blocks("a", 2) == 2
    assert mgr.get_num_common_prefix_blocks("a", 3) == 0


def test_decode_steps_grow_the_table_one_block_at_a_time():
    mgr = KVCacheManager(16, BLOCK)
    tokens = [1, 2, 3]
    assert mgr.allocate_slots("a", tokens, 3) == [1]
    computed = 3
    grown = []
    for next_token in range(10, 20):
        tokens.append(next_token)
        new = mgr.allocate_slots("a", tokens, 1, num_computed_tokens=computed)
        computed += 1
        grown.extend(new)
    assert grown == [2, 3, 4]
    assert mgr.get_block_ids("a") == [1, 2, 3, 4]
    # Every full block got cached: a new request with the same tokens hits all of them.
    assert mgr.get_computed_blocks("b", [*tokens, 0]).num_computed_tokens == 12


def test_lookahead_slots_get_blocks_but_are_not_cached():
    mgr = KVCacheManager(16, BLOCK)
    tokens = [1, 2, 3, 4, 5]
    assert len(mgr.allocate_slots("a", tokens, 5, num_lookahead_tokens=4)) == 3
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1


def test_none_when_out_of_blocks_and_nothing_changes():
    mgr = KVCacheManager(5, BLOCK)  # four usable blocks
    run_prefill(mgr, "a", list(range(8)))
    mgr.free("a")  # two cached free blocks
    before = (mgr.num_free_blocks, dict(mgr.block_pool.cached_block_hash_to_block))
    hit = mgr.get_computed_blocks("b", list(range(8)) + list(range(50, 62)))
    assert hit.num_computed_tokens == 8
    # 20 tokens need 5 blocks: 2 hits + 3 new, but only 2 free blocks remain besides the hits.
    assert mgr.allocate_slots("b", list(range(20)), 12, computed=hit) is None
    assert (mgr.num_free_blocks, dict(mgr.block_pool.cached_block_hash_to_block)) == before
    with pytest.raises(ValueError, match="unknown request"):
        mgr.get_block_ids("b")
    assert mgr.allocate_slots("b", list(range(8)) + [50] * 8, 8, computed=hit) == [3, 4]


def test_free_returns_blocks_in_reverse_order_so_tails_evict_first():
    mgr = KVCacheManager(8, BLOCK)
    tokens = list(range(13))
    mgr.allocate_slots("a", tokens, 13)
    ids = mgr.get_block_ids("a")
    mgr.free("a")
    queue = [block.block_id for block in mgr.block_pool.free_block_queue]
    # The partial (uncached) last block is reused first, then never-used blocks, then the
    # cached blocks from the tail of the prompt back to its head.
    assert queue[0] == ids[3]
    assert queue[-3:] == [ids[2], ids[1], ids[0]]


def test_usage_and_free_blocks():
    mgr = KVCacheManager(11, BLOCK)
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 10
    mgr.allocate_slots("a", [1] * 9, 9)
    assert mgr.usage == pytest.approx(0.3)
    assert mgr.num_free_blocks == 7
    mgr.free("a")
    assert mgr.usage == 0.0


def test_null_block_is_never_handed_out():
    mgr = KVCacheManager(3, BLOCK)
    assert mgr.allocate_slots("a", [1] * 8, 8) == [1, 2]
    assert mgr.allocate_slots("b", [1], 1) is None


def test_reset_prefix_cache_refused_while_in_use():
    mgr = KVCacheManager(8, BLOCK)
    run_prefill(mgr, "a", list(range(9)))
    assert mgr.reset_prefix_cache() is False
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    mgr.free("a")
    assert mgr.reset_prefix_cache() is True
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.get_computed_blocks("b", list(range(9))).num_computed_tokens == 0


def test_extras_separate_cache_entries():
    mgr = KVCacheManager(16, BLOCK)
    prompt = list(range(9))
    run_prefill(mgr, "a", prompt, extras=BlockHashExtras(lora_name="sql"))
    assert mgr.get_computed_blocks("b", prompt).num_computed_tokens == 0
    same = mgr.get_computed_blocks("c", prompt, BlockHashExtras(lora_name="sql"))
    assert same.num_computed_tokens == 8


def test_caching_disabled_never_hits():
    mgr = KVCacheManager(16, BLOCK, enable_caching=False)
    run_prefill(mgr, "a", list(range(9)))
    mgr.free("a")
    assert mgr.get_computed_blocks("b", list(range(9))).num_computed_tokens == 0
    assert mgr.block_pool.cached_block_hash_to_block == {}


def test_prefix_cache_stats_count_tokens_and_reset_on_take():
    mgr = KVCacheManager(16, BLOCK)
    run_prefill(mgr, "a", list(range(10)))
    run_prefill(mgr, "b", list(range(10)))
    stats = mgr.take_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert mgr.take_prefix_cache_stats().requests == 0


def test_stale_computed_blocks_are_refused():
    mgr = KVCacheManager(4, BLOCK)  # three usable blocks
    run_prefill(mgr, "a", list(range(8)))
    mgr.free("a")
    hit = mgr.get_computed_blocks("b", list(range(9)))
    assert hit.num_computed_tokens == 8
    mgr.allocate_slots("c", [7] * 12, 12)  # evicts both cached blocks
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate_slots("b", list(range(9)), 1, computed=hit)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_blocks": 8, "block_size": -2}, "block_size"),
        ({"num_blocks": 8, "block_size": 4, "hash_algo": "md5"}, "hash_algo"),
        ({"num_blocks": 8, "block_size": 4, "hash_seed": "text"}, "hash_seed"),
    ],
)
def test_bad_construction_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheManager(**kwargs)


def test_bad_calls_are_clear_errors_that_change_nothing():
    mgr = KVCacheManager(8, BLOCK)
    with pytest.raises(ValueError, match="unknown request"):
        mgr.free("nope")
    mgr.allocate_slots("a", [1, 2, 3], 3)
    with pytest.raises(ValueError, match="beyond"):
        mgr.allocate_slots("a", [1, 2, 3, 4, 5, 6], 1, num_computed_tokens=5)
    with pytest.raises(ValueError, match="beyond"):
        mgr.allocate_slots("new", [1, 2, 3], 1, num_computed_tokens=2)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots("a", [1, 2, 3], -1, num_computed_tokens=3)
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        mgr.allocate_slots("a", [1, 2, 3], 0, num_lookahead_tokens=-1)
    for bad in (1.5, "1", None):  # on the running request's common path too
        with pytest.raises(ValueError, match="num_new_tokens must be an int >= 0"):
            mgr.allocate_slots("a", [1, 2, 3], bad, num_computed_tokens=3)
    with pytest.raises(ValueError, match="num_computed_tokens must be an int >= 0"):
        mgr.allocate_slots("a", [1, 2, 3], 0, num_computed_tokens=3.0)
    with pytest.raises(ValueError, match="token_ids"):
        mgr.allocate_slots("a", [1, 2, 3, -4], 1, num_computed_tokens=3)
    assert mgr.get_block_ids("a") == [1]
    assert mgr.num_free_blocks == 6
    mgr.free("a")
    with pytest.raises(ValueError, match="already freed"):
        mgr.free("a")
    assert mgr.num_free_blocks == 7


def test_bad_token_ids_in_a_new_block_change_nothing():
    mgr = KVCacheManager(8, BLOCK)
    with pytest.raises(ValueError, match="token_ids"):
        mgr.allocate_slots("a", [1, 2, 3, 2**40, 5], 5)
    assert mgr.num_free_blocks == 7
    with pytest.raises(ValueError, match="unknown request"):
        mgr.free("a")


def test_extras_are_fixed_at_the_first_allocation():
    mgr = KVCacheManager(8, BLOCK)
    extras = BlockHashExtras(lora_name="sql")
    mgr.allocate_slots("a", [1, 2, 3], 3, extras=extras)
    assert mgr.allocate_slots("a", [1, 2, 3, 4], 1, num_computed_tokens=3) == []
    assert mgr.allocate_slots("a", [1, 2, 3, 4], 1, num_computed_tokens=3, extras=extras) == []
    with pytest.raises(ValueError, match="extras"):
        mgr.allocate_slots(
            "a", [1, 2, 3, 4], 1, num_computed_tokens=3, extras=BlockHashExtras(lora_name="x")
        )


def test_common_path_returns_no_blocks_until_a_block_fills():
    mgr = KVCacheManager(8, BLOCK)
    tokens = [1, 2]
    mgr.allocate_slots("a", tokens, 2)
    tokens.append(3)
    assert mgr.allocate_slots("a", tokens, 1, num_computed_tokens=2) == []
    assert mgr.block_pool.cached_block_hash_to_block == {}
    tokens.append(4)
    assert mgr.allocate_slots("a", tokens, 1, num_computed_tokens=3) == []
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1  # the block filled: cached
    tokens.append(5)
    assert mgr.allocate_slots("a", tokens, 1, num_computed_tokens=4) == [2]


def test_hit_must_be_taken_over_with_the_lookup_extras():
    mgr = KVCacheManager(8, BLOCK)
    extras = BlockHashExtras(cache_salt="s")
    run_prefill(mgr, "a", list(range(9)), extras=extras)
    hit = mgr.get_computed_blocks("b", list(range(9)), extras)
    with pytest.raises(ValueError, match="extras"):
        mgr.allocate_slots("b", list(range(9)), 1, computed=hit)
    assert len(mgr.allocate_slots("b", list(range(9)), 1, computed=hit, extras=extras)) == 1


def test_numpy_integer_counts_are_accepted():
    np = pytest.importorskip("numpy")
    mgr = KVCacheManager(8, BLOCK)
    tokens = np.arange(6)
    assert mgr.allocate_slots("a", tokens, np.int64(6), num_lookahead_tokens=np.int32(1)) == [1, 2]
    assert mgr.get_computed_blocks("b", np.arange(9)).num_computed_tokens == 4
