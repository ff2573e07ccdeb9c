"""The KV connector's worker side with a window group beside a full one: each group's chunks
are saved from and loaded into its own blocks, a window group's as the tail it still holds."""

from __future__ import annotations

import time

import torch

from ember_kv_cache import (
    BlockHasher,
    CPUTier,
    FullAttentionSpec,
    KVTransferConfig,
    LayoutFingerprint,
    SlidingWindowSpec,
    TieredConnectorScheduler,
    TieredKVStore,
)
from ember_kv_cache.group_chunks import group_chunk_hash
from ember_worker.kv_cache import KVCacheSpec, allocate_kv_cache
from ember_worker.kv_connector import TieredConnectorWorker

BLOCK, CHUNK = 2, 4
GROUPS = (SlidingWindowSpec(3), FullAttentionSpec())
SPEC = KVCacheSpec(num_layers=1, block_size=BLOCK, num_kv_heads=1, head_size=2, dtype=torch.float32)
TOKENS = list(range(1, 14))  # 3 whole chunks and one token to compute


def sides():
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "TieredConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_size": CHUNK,
                "tiers": [{"type": "cpu", "max_bytes": 10**6}],
            },
        }
    )
    fingerprint = LayoutFingerprint("m", "float32", BLOCK, 1, 1, 2, chunk_size=CHUNK, kv_groups="w")
    store = TieredKVStore([CPUTier(10**6)], fingerprint)
    scheduler = TieredConnectorScheduler(config, store, BlockHasher(BLOCK), GROUPS)
    worker = TieredConnectorWorker(store, SPEC, CHUNK, GROUPS)
    caches = allocate_kv_cache(SPEC, 40, torch.device("cpu"))
    for block in range(40):  # each block's keys and values name it
        caches[0][0][block] = block
        caches[0][1][block] = -block
    worker.register_kv_caches(caches)
    return scheduler, worker, caches


def save_first_request(scheduler, worker):
    scheduler.get_num_new_matched_tokens("a", TOKENS, 0)
    # Blocks 0..2 of the window group left its window (the null block 0 holds their place).
    tables = ([0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    worker.start_step(scheduler.build_connector_meta([("a", TOKENS, 12)], lambda r: tables))
    worker.finish_step(idle=False)


def load(scheduler, worker, tables, tokens=TOKENS) -> int:
    matched = (len(tokens) - 1) // CHUNK * CHUNK
    assert scheduler.get_num_new_matched_tokens("b", tokens, 0) == (matched, True)
    scheduler.update_state_after_alloc("b", tables, matched)
    worker.start_step(scheduler.build_connector_meta([], lambda r: tables))
    loaded = {}
    deadline = time.monotonic() + 10
    while not loaded and time.monotonic() < deadline:
        loaded, _ = scheduler.update_connector_output(worker.finish_step(idle=True))
    worker.start_step(scheduler.build_connector_meta([], lambda r: tables))
    worker.finish_step(idle=False)
    return loaded["b"]


def test_each_group_loads_its_own_blocks_and_a_window_only_its_tail():
    scheduler, worker, caches = sides()
    save_first_request(scheduler, worker)
    window, full = list(range(20, 26)), list(range(30, 36))
    assert load(scheduler, worker, (window, full)) == 12
    keys, values = caches[0]
    # The full group: every block, from blocks 7..12.
    assert keys[30:36, 0, 0, 0].tolist() == [7, 8, 9, 10, 11, 12]
    assert values[30:36, 0, 0, 0].tolist() == [-7, -8, -9, -10, -11, -12]
    # The window group (3 tokens: blocks 4 and 5 at 12 tokens): its last chunk, from blocks 5
    # and 6; nothing before it is read.
    assert keys[24:26, 0, 0, 0].tolist() == [5, 6]
    assert keys[20:24, 0, 0, 0].tolist() == [20, 21, 22, 23]


def test_a_window_loads_the_tail_a_chunk_kept_after_its_first_blocks_left():
    scheduler, worker, caches = sides()
    save_first_request(scheduler, worker)
    # At 8 tokens the window reads block 3: chunk 1 kept only that block (id 4) when saved.
    assert load(scheduler, worker, ([20, 21, 22, 23], [30, 31, 32, 33]), TOKENS[:9]) == 8
    keys = caches[0][0]
    assert keys[20:24, 0, 0, 0].tolist() == [20, 21, 22, 4]
    assert keys[30:34, 0, 0, 0].tolist() == [7, 8, 9, 10]


def test_a_window_tail_missing_at_load_leaves_only_the_local_hit_in_place():
    scheduler, worker, _ = sides()
    save_first_request(scheduler, worker)
    store = scheduler.store
    hashes = BlockHasher(BLOCK).hash_prefix(TOKENS)
    tail = group_chunk_hash(hashes[5], 0)
    get = store.get
    store.get = lambda key: None if key == tail else get(key)  # gone after the lookup
    assert load(scheduler, worker, (list(range(20, 26)), list(range(30, 36)))) == 0
