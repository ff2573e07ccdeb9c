"""Free queue and block pool: O(1) linking, eviction order, references and errors."""

import pytest

from ember_kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue):
    return [block.block_id for block in queue]


def test_free_queue_links_in_constant_time_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and len(queue) == 4
    queue.appendleft(blocks[2])
    assert queue.popleft() is blocks[2]
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    queue.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
    for _ in range(4):
        queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert len(queue) == 0


def test_pool_keeps_the_null_block_out():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 3
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([pool.null_block])


def test_eviction_order_uncached_first_then_least_recently_used():
    pool = BlockPool(7)
    blocks = pool.get_new_blocks(6)
    for block in blocks[:4]:
        pool.cache_full_block(block, bytes([block.block_id]), None, [0], ())
    pool.free_blocks([blocks[1], blocks[0]])  # cached: least recently used first
    pool.free_blocks([blocks[4]])  # uncached: straight to the front
    pool.free_blocks([blocks[3], blocks[2]])
    pool.free_blocks([blocks[5]])
    assert ids(pool.free_block_queue) == [6, 5, 2, 1, 4, 3]
    reused = pool.get_new_blocks(3)
    assert [b.block_id for b in reused] == [6, 5, 2]
    assert bytes([2]) not in pool.cached_block_hash_to_block  # evicted lazily, on reuse
    assert pool.get_cached_block(bytes([1])) is blocks[0]


def test_touch_takes_a_free_cached_block_off_the_queue():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h", None, [0], ())
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    assert block.block_id not in ids(pool.free_block_queue)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([block])
    assert pool.num_free_blocks == 3


def test_duplicate_hash_leaves_the_second_block_uncached():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, b"h", None, [0], ())
    pool.cache_full_block(second, b"h", None, [0], ())
    assert pool.cached_block_hash_to_block == {b"h": first}
    assert second.block_hash is None


def test_reset_only_when_nothing_is_in_use():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h", None, [0], ())
    assert pool.reset_prefix_cache() is False
    assert pool.cached_block_hash_to_block == {b"h": block}
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and block.block_hash is None


@pytest.mark.parametrize("num_blocks", [0, 1, -3, 2.5])
def test_bad_pool_size(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)
