"""Another engine's view: a paged numpy KV store managed by ember-kv-cache.

Four requests share a system prompt; the prefix cache lets each reuse the KV blocks the first one
wrote. Run: python3 examples/paged_numpy_store.py
"""

import numpy as np

from ember_kv_cache import KVCacheManager

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM = 4, 32, 8
kv_store = np.zeros((NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), dtype=np.float32)  # block 0: null block
mgr = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)


def compute_kv(token_ids, positions):  # stands in for the model's key/value projection
    return np.sin(np.outer(np.asarray(token_ids) + 0.1 * positions, np.arange(1, HEAD_DIM + 1)))


def write_kv(request_id, token_ids, start):  # compute KV for token_ids[start:] into its blocks
    table = np.asarray(mgr.get_block_ids(request_id))
    pos = np.arange(start, len(token_ids))
    kv_store[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = compute_kv(token_ids[start:], pos)
    everything = np.arange(len(token_ids))  # read the sequence back through the block table
    gathered = kv_store[table[everything // BLOCK_SIZE], everything % BLOCK_SIZE]
    assert np.allclose(gathered, compute_kv(token_ids, everything))


system_prompt = list(range(100, 114))
requests = {f"req-{i}": [*system_prompt, 7 * i, 7 * i + 1] for i in range(4)}
for request_id, token_ids in requests.items():
    hit = mgr.get_computed_blocks(request_id, token_ids)
    mgr.allocate_slots(
        request_id, token_ids, len(token_ids) - hit.num_computed_tokens, computed=hit
    )
    write_kv(request_id, token_ids, hit.num_computed_tokens)
    print(f"{request_id}: reused {hit.num_computed_tokens:2d} of {len(token_ids)} prompt tokens")
for step in range(6):  # decode: one new token per request per step
    for request_id, token_ids in requests.items():
        token_ids.append(step)
        if (
            mgr.allocate_slots(request_id, token_ids, 1, num_computed_tokens=len(token_ids) - 1)
            is None
        ):
            raise RuntimeError("out of KV blocks: a real engine would preempt a request here")
        write_kv(request_id, token_ids, len(token_ids) - 1)
for request_id in requests:
    mgr.free(request_id)
stats = mgr.take_prefix_cache_stats()
print(
    f"prefix-cache hit rate: {stats.hit_rate:.1%} ({stats.hits} of {stats.queries} prompt tokens)"
)
