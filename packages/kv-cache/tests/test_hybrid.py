"""Layer specs and groups: sliding-window, chunked local and state block tables over one pool."""

import pytest

from ember_kv_cache import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HybridKVCacheManager,
    LocalAttentionManager,
    SlidingWindowSpec,
    StateSpec,
    group_layers,
    group_layers_evenly,
    max_tokens_per_request,
)
from ember_kv_cache.spec_managers import longest_hit

BLOCK = 4


def decode(mgr, request_id, tokens, steps, start=100):
    for step in range(steps):
        tokens.append(start + step)
        assert (
            mgr.allocate_slots(request_id, tokens, 1, num_computed_tokens=len(tokens) - 1)
            is not None
        )


def test_specs_say_what_a_query_no_longer_sees():
    assert FullAttentionSpec().num_skipped_tokens(100) == 0
    assert SlidingWindowSpec(8).num_skipped_tokens(100) == 93  # sees 93..100
    assert SlidingWindowSpec(8).num_skipped_tokens(5) == 0
    assert ChunkedLocalAttentionSpec(16).num_skipped_tokens(35) == 32
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(0)
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedLocalAttentionSpec(-1)


def test_group_layers_groups_equal_specs_in_first_layer_order():
    local, full = SlidingWindowSpec(4096), FullAttentionSpec()
    groups = group_layers([local, local, full, local, full])
    assert [(g.spec, g.layer_ids) for g in groups] == [(local, (0, 1, 3)), (full, (2, 4))]
    assert len(group_layers([full] * 3)) == 1
    with pytest.raises(ValueError, match=r"layer_specs\[1\]"):
        group_layers([full, "full"])


def test_window_blocks_held_stay_flat_and_return_to_the_pool():
    mgr = LocalAttentionManager(64, BLOCK, SlidingWindowSpec(8))
    tokens = list(range(6))
    assert mgr.allocate_slots("a", tokens, 6) is not None
    held = []
    for _ in range(60):
        decode(mgr, "a", tokens, 1)
        held.append(sum(1 for b in mgr.get_block_ids("a") if b != 0))
    # The next query sees 8 tokens: at most 3 blocks of 4 (unaligned) plus the one being written.
    assert max(held) <= 4 and held[-1] == held[-5]
    assert mgr.num_free_blocks == 63 - held[-1]
    table = mgr.get_block_ids("a")
    assert len(table) == -(-len(tokens) // BLOCK) and table[0] == 0
    mgr.free("a")
    assert mgr.num_free_blocks == 63 and mgr.usage == 0.0


def test_window_serves_a_sequence_far_longer_than_the_pool():
    mgr = LocalAttentionManager(6, BLOCK, SlidingWindowSpec(8))  # 5 usable blocks: 20 tokens
    tokens = [1, 2, 3]
    assert mgr.allocate_slots("a", tokens, 3) is not None
    decode(mgr, "a", tokens, 500)
    assert len(tokens) == 503


def test_chunked_local_frees_whole_chunks():
    mgr = LocalAttentionManager(32, BLOCK, ChunkedLocalAttentionSpec(8))
    tokens = list(range(8))
    mgr.allocate_slots("a", tokens, 8)
    decode(mgr, "a", tokens, 1)  # position 8 starts a chunk: positions 0..7 are unseen
    assert mgr.get_block_ids("a")[:2] == [0, 0]


def test_longest_hit_searches_from_the_right_for_the_window_tail():
    cached = {h: None for h in (b"2", b"3", b"5", b"6", b"7")}
    hashes = [b"0", b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"8"]
    assert longest_hit(hashes, cached, lambda n: 0) == 0  # full attention: block 0 missing
    assert longest_hit(hashes, cached, lambda n: max(0, n - 2)) == 8  # needs blocks 6, 7
    assert longest_hit(hashes, cached, lambda n: max(0, n - 3)) == 8  # needs blocks 5..7
    assert longest_hit(hashes, cached, lambda n: max(0, n - 4)) == 0  # no 4 cached in a row
    assert longest_hit(hashes[:5], cached, lambda n: max(0, n - 2)) == 4  # needs blocks 2, 3


def test_window_prefix_hit_needs_only_the_tail_after_the_head_was_evicted():
    mgr = LocalAttentionManager(12, BLOCK, SlidingWindowSpec(6))
    prompt = list(range(32))  # 8 blocks
    assert mgr.allocate_slots("a", prompt, 32) is not None
    mgr.free("a")
    # Another request takes the free blocks from the front: the prompt's head is evicted first.
    assert mgr.allocate_slots("b", list(range(500, 512)), 12) is not None
    mgr.free("b")
    hit = mgr.get_computed_blocks("c", [*prompt, 7])
    assert hit.num_computed_tokens == 32
    assert hit.block_ids[:5] == [0] * 5 and 0 not in hit.block_ids[6:]
    free_before = mgr.num_free_blocks
    assert mgr.allocate_slots("c", [*prompt, 7], 1, computed=hit) is not None
    assert mgr.num_free_blocks == free_before - 3  # two hit blocks back in use, one new block
    assert mgr.get_block_ids("c")[:6] == [0] * 6  # block 5 left the window at position 32
    full = HybridKVCacheManager(12, BLOCK, [FullAttentionSpec()])
    assert full.get_computed_blocks("x", [*prompt, 7]).num_computed_tokens == 0


def test_hybrid_allocates_per_group_from_one_pool_or_not_at_all():
    mgr = HybridKVCacheManager(12, BLOCK, [FullAttentionSpec(), SlidingWindowSpec(4)])
    new = mgr.allocate_slots("a", list(range(8)), 8)
    assert len(new) == 2 and len(new[0]) == 2 and len(new[1]) == 2
    assert not set(new[0]) & set(new[1])
    free = mgr.num_free_blocks
    assert mgr.allocate_slots("b", list(range(20)), 20) is None  # 5 + 5 > 7
    assert mgr.num_free_blocks == free
    with pytest.raises(ValueError, match="unknown request 'b'"):
        mgr.get_block_ids("b")
    tokens = list(range(8))
    decode(mgr, "a", tokens, 8)
    full, local = mgr.get_block_ids("a")
    assert 0 not in full and local[:2] == [0, 0]
    mgr.free("a")
    assert mgr.usage == 0.0


def test_hybrid_hit_is_the_longest_every_group_continues_from():
    mgr = HybridKVCacheManager(40, BLOCK, [SlidingWindowSpec(4), FullAttentionSpec()])
    prompt = list(range(24))
    assert mgr.allocate_slots("a", prompt, 24) is not None
    mgr.free("a")
    hit = mgr.get_computed_blocks("b", [*prompt, 1])
    assert hit.num_computed_tokens == 24
    assert hit.block_ids[1] == mgr.get_computed_blocks("c", [*prompt, 1]).block_ids[1]
    assert hit.block_ids[0][:5] == [0] * 5
    assert mgr.allocate_slots("b", [*prompt, 1], 1, computed=hit) is not None
    assert mgr.take_prefix_cache_stats().hits == 48
    # Group 1 hashes under its own seed: its blocks are not group 0's.
    assert mgr.groups[0].hasher.root_hash != mgr.groups[1].hasher.root_hash


def test_state_group_holds_one_block_and_turns_prefix_caching_off():
    mgr = HybridKVCacheManager(16, BLOCK, [FullAttentionSpec(), StateSpec()])
    tokens = list(range(10))
    assert [len(ids) for ids in mgr.allocate_slots("a", tokens, 10)] == [3, 1]
    decode(mgr, "a", tokens, 20)
    full, state = mgr.get_block_ids("a")
    assert len(full) == 8 and len(state) == 1
    mgr.free("a")
    assert not mgr.enable_caching
    assert mgr.get_computed_blocks("b", tokens).num_computed_tokens == 0


def test_capacity_is_unbounded_once_the_windows_fit():
    local = SlidingWindowSpec(64)
    assert max_tokens_per_request([local], 11, 16, 64) is None  # ceil(127/16)+1 = 9 blocks
    assert max_tokens_per_request([local], 8, 16, 64) == 128
    assert max_tokens_per_request([FullAttentionSpec()], 11, 16, 64) == 176
    assert max_tokens_per_request([local, StateSpec()], 10, 16, 64) is None
    # Full attention beside a window: k blocks of full attention plus at most 9 of the window.
    assert max_tokens_per_request([FullAttentionSpec(), local], 40, 16, 64) == 31 * 16
    assert max_tokens_per_request([FullAttentionSpec(), local], 12, 16, 64) == 6 * 16
    assert HybridKVCacheManager(12, 16, [local]).max_tokens_per_request(64) is None


def test_even_groups_split_the_larger_kind_into_runs_of_the_smaller_ones_size():
    local, full = SlidingWindowSpec(8), FullAttentionSpec()
    layers = [local] * 5 + [full] + [local] * 5 + [full]  # Gemma 3's pattern
    groups = group_layers_evenly(layers)
    assert [g.layer_ids for g in groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)]
    assert [g.spec for g in groups] == [local] * 5 + [full]


def test_interleaved_tables_are_one_row_that_grows_by_appending():
    mgr = HybridKVCacheManager(
        32, BLOCK, [SlidingWindowSpec(4), FullAttentionSpec()], interleave_block_ids=True
    )
    tokens = list(range(6))
    first = mgr.allocate_slots("a", tokens, 6)
    assert len(first) == 4
    row = list(first)
    decode(mgr, "a", tokens, 1)  # fits the held blocks: nothing new
    for _ in range(9):
        tokens.append(7)
        row += mgr.allocate_slots("a", tokens, 1, num_computed_tokens=len(tokens) - 1)
    table = mgr.get_block_ids("a")
    assert len(table) == 2 * -(-len(tokens) // BLOCK)
    local, full = mgr.groups[0].get_block_ids("a"), mgr.groups[1].get_block_ids("a")
    assert table[0::2] == local and table[1::2] == full
    # The row a worker built by appending holds the same ids, except where the window freed
    # blocks (the manager's table has the null block there; nothing reads them any more).
    assert row[1::2] == full
    assert all(a == b for a, b in zip(row[0::2], local) if b != 0)


def test_a_state_groups_block_leads_the_interleaved_row():
    # A Mamba hybrid whose first layer is a Mamba layer: the state group is group 0.
    mgr = HybridKVCacheManager(
        32, BLOCK, [StateSpec(), FullAttentionSpec()], interleave_block_ids=True
    )
    assert mgr.num_state_groups == 1
    tokens = list(range(6))
    row = list(mgr.allocate_slots("a", tokens, 6))
    assert len(row) == 1 + 2
    for _ in range(7):
        tokens.append(7)
        row += mgr.allocate_slots("a", tokens, 1, num_computed_tokens=len(tokens) - 1)
    state, full = mgr.groups[0].get_block_ids("a"), mgr.groups[1].get_block_ids("a")
    assert row == mgr.get_block_ids("a") == state + full
    assert len(full) == -(-len(tokens) // BLOCK) and state[0] not in full
    mgr.free("a")
    assert mgr.num_free_blocks == 31


def test_a_state_group_turns_prefix_caching_off_with_one_log_line(caplog):
    with caplog.at_level("INFO", logger="ember_kv_cache.hybrid_manager"):
        mgr = HybridKVCacheManager(8, BLOCK, [FullAttentionSpec(), StateSpec()])
        HybridKVCacheManager(8, BLOCK, [FullAttentionSpec(), StateSpec()], enable_caching=False)
    assert not mgr.enable_caching
    assert [r.message for r in caplog.records if "prefix caching is off" in r.message] != []
    assert len(caplog.records) == 1
    # An engine reports the hash algorithm whether or not caching is on.
    assert mgr.hasher.algo == HybridKVCacheManager(8, BLOCK, [StateSpec()]).hasher.algo


def test_even_groups_keep_a_state_group_whole():
    state, full = StateSpec(), FullAttentionSpec()
    groups = group_layers_evenly([state, full, state, state, full, state])
    assert [(g.spec, g.layer_ids) for g in groups] == [(state, (0, 2, 3, 5)), (full, (1, 4))]
    assert group_layers_evenly([state, state])[0].layer_ids == (0, 1)


def test_kv_events_name_the_group_of_each_block():
    from ember_kv_cache import BlockRemoved, BlockStored

    mgr = HybridKVCacheManager(
        5, BLOCK, [FullAttentionSpec(), SlidingWindowSpec(4)], enable_kv_events=True
    )
    assert mgr.allocate_slots("a", list(range(8)), 8) is not None
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    assert sorted(e.group for e in stored) == [0, 0, 1, 1]
    ids = mgr.get_block_ids("a")
    assert {e.block_id for e in stored if e.group == 1} == set(ids[1])
    mgr.free("a")
    assert mgr.allocate_slots("b", list(range(100, 116)), 8) is not None  # evicts all four
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(e.group for e in removed) == [0, 0, 1, 1]
