"""KVCacheManager with ``reuse_partial_blocks``: hits that end inside a block, served by a copy."""

import pytest

from ember_kv_cache import BlockHashExtras, KVCacheManager

BLOCK = 4


def prefill(mgr: KVCacheManager, request_id: str, tokens: list[int], **kw):
    hit = mgr.get_computed_blocks(request_id, tokens, kw.get("extras"))
    new = mgr.allocate_slots(
        request_id, tokens, len(tokens) - hit.num_computed_tokens, computed=hit, **kw
    )
    assert new is not None
    return hit


def finish(mgr: KVCacheManager, request_id: str, tokens: list[int], num_computed: int) -> None:
    mgr.take_block_copies()  # the step that computed them ran
    mgr.free(request_id, tokens, num_computed)


def test_a_finished_requests_partial_block_serves_a_repeat_by_copy():
    mgr = KVCacheManager(32, BLOCK, reuse_partial_blocks=True)
    prompt = list(range(10))  # two whole blocks and two tokens
    prefill(mgr, "a", prompt)
    a_tail = mgr.get_block_ids("a")[2]
    finish(mgr, "a", prompt, 10)
    hit = prefill(mgr, "b", prompt)
    assert hit.num_computed_tokens == 9  # the last token is computed again
    assert (hit.num_partial_tokens, hit.partial_block.block_id) == (1, a_tail)
    b_tail = mgr.get_block_ids("b")[2]
    copies = mgr.take_block_copies()
    assert copies == ([] if b_tail == a_tail else [(a_tail, b_tail)])
    assert mgr.take_block_copies() == []


def test_the_next_turn_reuses_the_answer_in_the_last_block():
    mgr = KVCacheManager(32, BLOCK, reuse_partial_blocks=True)
    prompt, answer = [5, 6, 7, 8, 9], [40, 41, 42]
    prefill(mgr, "a", prompt)
    mgr.allocate_slots("a", [*prompt, 40], 1, num_computed_tokens=5)
    mgr.allocate_slots("a", [*prompt, 40, 41], 1, num_computed_tokens=6)
    # Finished with 42 sampled: the KV of 5 prompt tokens and 40, 41 is written, not 42's.
    finish(mgr, "a", [*prompt, *answer], 7)
    turn = [*prompt, *answer, 50, 51]
    hit = mgr.get_computed_blocks("b", turn)
    assert (hit.num_computed_tokens, hit.num_partial_tokens) == (7, 3)
    assert mgr.get_computed_blocks("c", [*prompt, 40, 99, 1]).num_computed_tokens == 6


def test_a_cached_whole_block_serves_all_but_the_last_token():
    mgr = KVCacheManager(32, BLOCK, reuse_partial_blocks=True)
    prompt = list(range(12))  # exactly three blocks
    prefill(mgr, "a", prompt)
    finish(mgr, "a", prompt, 12)
    hit = prefill(mgr, "b", prompt)
    assert (len(hit.block_ids), hit.num_partial_tokens, hit.num_computed_tokens) == (2, 3, 11)
    assert hit.partial_block.block_hash is not None


def test_a_prompt_asked_again_after_a_long_answer_copies_the_start_of_the_block_it_filled():
    mgr = KVCacheManager(32, BLOCK, reuse_partial_blocks=True)
    prompt = [5, 6, 7, 8, 9, 10]  # its last two tokens start block 1
    prefill(mgr, "a", prompt)
    tokens = [*prompt, 40, 41, 42, 43]  # the answer fills block 1 (cached whole) and goes on
    for n in range(6, 10):
        mgr.allocate_slots("a", tokens[: n + 1], 1, num_computed_tokens=n)
    a_blocks = mgr.get_block_ids("a")
    finish(mgr, "a", tokens, 10)
    hit = mgr.get_computed_blocks("b", prompt)
    assert (hit.num_computed_tokens, hit.num_partial_tokens) == (5, 1)
    assert hit.partial_block.block_id == a_blocks[1]


def test_a_block_cached_in_this_step_is_no_copy_source_until_the_step_ends():
    mgr = KVCacheManager(32, BLOCK, reuse_partial_blocks=True)
    prompt = [1, 1, 1, 1]
    prefill(mgr, "a", prompt)  # its block is cached now, its KV written by the coming forward
    assert mgr.get_computed_blocks("b", prompt).num_computed_tokens == 0
    assert mgr.get_computed_blocks("b", [1, 1, 1, 2, 3]).num_computed_tokens == 0
    mgr.take_block_copies()
    assert mgr.get_computed_blocks("b", prompt).num_computed_tokens == 3
    assert mgr.get_computed_blocks("b", [1, 1, 1, 2, 3]).num_computed_tokens == 3


def test_a_partial_block_handed_out_again_is_forgotten_and_a_stale_hit_refused():
    mgr = KVCacheManager(4, BLOCK, reuse_partial_blocks=True)  # three usable blocks
    prompt = [1, 2, 3, 4, 5, 6]
    prefill(mgr, "a", prompt)
    finish(mgr, "a", prompt, 6)
    hit = mgr.get_computed_blocks("b", prompt)
    assert hit.num_partial_tokens == 1
    prefill(mgr, "c", list(range(100, 112)))  # takes every block
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate_slots("b", prompt, 1, computed=hit)
    mgr.free("c")
    assert mgr.get_computed_blocks("b", prompt).num_computed_tokens == 0
    indexed = [b.partial for blocks in mgr.block_pool.partial_blocks.values() for b in blocks]
    assert all(p.token_ids[0] >= 100 for p in indexed)  # c's blocks only


def test_partial_blocks_are_evicted_before_the_blocks_before_them():
    mgr = KVCacheManager(5, BLOCK, reuse_partial_blocks=True)  # four usable blocks
    prompt = [1, 2, 3, 4, 5, 6]
    prefill(mgr, "a", prompt)
    finish(mgr, "a", prompt, 6)
    prefill(mgr, "b", [9, 9, 9])  # the two uncached blocks go first
    prefill(mgr, "c", [8, 8, 8])
    assert mgr.get_computed_blocks("x", prompt).num_computed_tokens == 5
    prefill(mgr, "d", [7, 7, 7])  # then the partial block
    assert mgr.get_computed_blocks("x", prompt).num_computed_tokens == 4


def test_extras_and_the_limit_per_parent_separate_partial_blocks():
    mgr = KVCacheManager(64, BLOCK, reuse_partial_blocks=True)
    salted = BlockHashExtras(cache_salt="s")
    prefill(mgr, "a", [1, 2], extras=salted)
    finish(mgr, "a", [1, 2], 2)
    assert mgr.get_computed_blocks("b", [1, 2, 3]).num_computed_tokens == 0
    assert mgr.get_computed_blocks("b", [1, 2, 3], salted).num_computed_tokens == 2
    limit = mgr.block_pool.MAX_PARTIAL_PER_PARENT
    for i in range(limit + 1):
        prefill(mgr, f"r{i}", [50 + i, 1])
        finish(mgr, f"r{i}", [50 + i, 1], 2)
    assert mgr.get_computed_blocks("x", [50, 1, 0]).num_computed_tokens == 0  # the oldest
    assert mgr.get_computed_blocks("x", [50 + limit, 1, 0]).num_computed_tokens == 2


def test_off_by_default_and_free_checks_its_counts():
    mgr = KVCacheManager(16, BLOCK)
    prefill(mgr, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_computed_tokens"):
        mgr.free("a", [1, 2, 3], 4)
    mgr.free("a", [1, 2, 3], 3)
    assert mgr.get_computed_blocks("b", [1, 2, 3]).num_computed_tokens == 0
    assert mgr.take_block_copies() == []
