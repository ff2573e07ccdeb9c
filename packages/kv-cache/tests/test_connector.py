"""The tiered connector's configuration and scheduler side, and delayed block caching."""

from __future__ import annotations

import numpy as np
import pytest

from ember_kv_cache import (
    BlockHasher,
    CPUTier,
    KVCacheManager,
    KVConnectorOutput,
    KVTransferConfig,
    LayoutFingerprint,
    TieredConnectorScheduler,
    TieredKVStore,
)

BLOCK, CHUNK = 4, 8
FP = LayoutFingerprint("m", "float32", BLOCK, 1, 1, 2, chunk_size=CHUNK)


def config(role="kv_both", **extra):
    extra = {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "max_bytes": 10**6}], **extra}
    return {"kv_connector": "TieredConnector", "kv_role": role, "kv_connector_extra_config": extra}


def connector(role="kv_both") -> TieredConnectorScheduler:
    cfg = KVTransferConfig.from_dict(config(role))
    return TieredConnectorScheduler(cfg, TieredKVStore([CPUTier(10**6)], FP), BlockHasher(BLOCK))


def chunk_hashes(tokens):
    return BlockHasher(BLOCK).hash_prefix(tokens)[CHUNK // BLOCK - 1 :: CHUNK // BLOCK]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"kv_connector": "NixlConnector"}, "kv_connector must be one of"),
        ({"kv_role": "kv_everything"}, "kv_role must be one of"),
        ({"kv_parallel_size": 2}, "unknown keys"),
        ({"kv_connector_extra_config": {"tiers": []}}, "non-empty list"),
        (
            {
                "kv_connector_extra_config": {
                    "chunk_size": 0,
                    "tiers": [{"type": "cpu", "max_bytes": 1}],
                }
            },
            "chunk_size must be a positive int",
        ),
        ({"kv_connector_extra_config": {"tiers": [{"type": "floppy"}]}}, "tier type"),
        ({"kv_connector_extra_config": {"tiers": [{"type": "redis", "url": "x"}]}}, "redis://"),
    ],
)
def test_bad_config_is_a_value_error_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.from_dict({**config(), **bad})


def test_chunk_size_must_be_a_multiple_of_the_block_size():
    cfg = KVTransferConfig.from_dict(config(chunk_size=6))
    with pytest.raises(ValueError, match="multiple of the block size"):
        TieredConnectorScheduler(cfg, TieredKVStore([CPUTier(10)], FP), BlockHasher(BLOCK))


def test_matches_whole_stored_chunks_past_the_local_hit_leaving_one_token():
    conn = connector()
    tokens = list(range(100, 125))  # 3 whole chunks, one token past them
    hashes = chunk_hashes(tokens)
    for chunk_hash in hashes[:2]:
        conn.store.put(chunk_hash, np.zeros(3))
    assert conn.get_num_new_matched_tokens("r", tokens, 0) == (16, True)
    conn.update_state_after_alloc("r", list(range(1, 8)), 16)
    meta = conn.build_connector_meta([], lambda r: [])
    [load] = meta.loads
    assert (load.first_chunk, load.chunk_hashes, load.skip_tokens) == (0, hashes[:2], 0)
    # A local hit of one block: the load starts mid-chunk and skips it.
    assert conn.get_num_new_matched_tokens("s", tokens, 4) == (12, True)
    conn.store.put(hashes[2], np.zeros(3))
    # Every chunk stored, but a 24-token prompt keeps its last chunk to compute.
    assert conn.get_num_new_matched_tokens("t", tokens[:24], 0) == (16, True)
    assert conn.get_num_new_matched_tokens("u", [1] * 24, 0) == (0, False)
    stats = conn.take_stats()
    assert (stats.lookup_tokens, stats.matched_tokens) == (25 + 21 + 24 + 24, 16 + 12 + 16)


def test_saves_each_chunk_once_as_it_becomes_computed():
    conn = connector("kv_producer")
    tokens = list(range(30))
    assert conn.get_num_new_matched_tokens("r", tokens, 0) == (0, False)  # a producer loads not
    conn.update_state_after_alloc("r", [], 0)
    blocks = list(range(1, 9))
    assert conn.build_connector_meta([("r", tokens, 6)], lambda r: blocks).saves == []
    [save] = conn.build_connector_meta([("r", tokens, 20)], lambda r: blocks).saves
    assert (save.first_chunk, save.chunk_hashes, save.block_ids) == (
        0,
        chunk_hashes(tokens)[:2],
        blocks,
    )
    [save] = conn.build_connector_meta([("r", tokens, 30)], lambda r: blocks).saves
    assert (save.first_chunk, save.chunk_hashes) == (2, chunk_hashes(tokens)[2:3])
    assert conn.request_finished("r") == (False, None)
    assert conn.build_connector_meta([("r", tokens, 30)], lambda r: blocks).saves == []


def test_consumer_saves_nothing_and_loaded_chunks_are_not_saved_again():
    consumer = connector("kv_consumer")
    tokens = list(range(30))
    consumer.get_num_new_matched_tokens("r", tokens, 0)
    assert consumer.build_connector_meta([("r", tokens, 30)], lambda r: [0] * 8).saves == []
    both = connector()
    both.store.put(chunk_hashes(tokens)[0], np.zeros(1))
    assert both.get_num_new_matched_tokens("r", tokens, 0) == (8, True)
    both.update_state_after_alloc("r", [1, 2], 8)
    meta = both.build_connector_meta([("r", tokens, 16)], lambda r: [1, 2, 3, 4])
    assert [s.first_chunk for s in meta.saves] == [1]
    assert both.update_connector_output(KVConnectorOutput({"r": 8})) == ({"r": 8}, [])
    assert both.build_connector_meta([], lambda r: []).writes == ["r"]


def test_a_finished_request_saves_its_prompts_partial_chunk_and_a_lookup_finds_it():
    conn = connector()
    prompt = list(range(100, 122))  # 2 whole chunks, then 1 whole block and 2 tokens
    hashes = BlockHasher(BLOCK).hash_prefix(prompt)
    conn.get_num_new_matched_tokens("r", prompt, 0)
    conn.update_state_after_alloc("r", [], 0)
    conn.build_connector_meta([("r", prompt, 22)], lambda r: list(range(1, 7)))
    # Finished: block 4 (tokens 16-20) is the prompt's last whole block, in partial chunk 2.
    assert conn.request_finished("r", prompt, 25, list(range(1, 8))) == (True, None)
    [save] = conn.build_connector_meta([], lambda r: []).saves
    assert (save.first_chunk, save.chunk_hashes, save.partial_blocks) == (2, [hashes[4]], 1)
    assert save.block_ids == list(range(1, 8))
    conn.store.put(hashes[1], np.zeros(1))
    conn.store.put(hashes[3], np.zeros(1))
    conn.store.put(hashes[4], np.zeros(1))
    # Already stored: nothing to save, nothing to wait for.
    conn.get_num_new_matched_tokens("again", prompt, 0)
    assert conn.request_finished("again", prompt, 22, [1]) == (False, None)
    # An identical prompt loads both chunks and the partial one's block: 20 of 22 tokens.
    assert conn.get_num_new_matched_tokens("s", prompt, 0) == (20, True)
    conn.update_state_after_alloc("s", list(range(1, 6)), 20)
    [load] = conn.build_connector_meta([], lambda r: []).loads
    assert (load.chunk_hashes, load.partial_blocks) == ([hashes[1], hashes[3], hashes[4]], 1)
    # A prompt ending in that block (20 tokens) may take none of it: one token stays to compute.
    assert conn.get_num_new_matched_tokens("t", prompt[:20], 0) == (16, True)
    # Another tail after the same whole chunks misses the partial key.
    assert conn.get_num_new_matched_tokens("u", prompt[:16] + [7] * 6, 0) == (16, True)


def test_the_partial_chunk_lookup_asks_the_tier_once_for_every_candidate_key():
    class CountingCPUTier(CPUTier):
        def contains_many(self, keys):
            self.asked.append(list(keys))
            return super().contains_many(keys)

    cfg = KVTransferConfig.from_dict(config(chunk_size=16))
    fingerprint = LayoutFingerprint("m", "float32", BLOCK, 1, 1, 2, chunk_size=16)
    tier = CountingCPUTier(10**6)
    tier.asked = []
    conn = TieredConnectorScheduler(cfg, TieredKVStore([tier], fingerprint), BlockHasher(BLOCK))
    prompt = list(range(200, 230))  # 1 whole chunk, then 3 whole blocks and 2 tokens
    hashes = BlockHasher(BLOCK).hash_prefix(prompt)
    for stored in (hashes[3], hashes[4], hashes[5]):  # the chunk, partial keys of 1 and 2 blocks
        conn.store.put(stored, np.zeros(1))
    assert conn.get_num_new_matched_tokens("r", prompt, 0) == (24, True)
    partial_keys = [fingerprint.tier_key(h) for h in hashes[4:7]]
    assert tier.asked == [[fingerprint.tier_key(hashes[3])], partial_keys]


def test_delay_cache_blocks_caches_only_once_the_tokens_count_as_computed():
    mgr = KVCacheManager(16, BLOCK)
    tokens = list(range(13))
    assert mgr.allocate_slots("r", tokens, 8, delay_cache_blocks=True) == [1, 2]
    assert mgr.get_computed_blocks("probe", tokens).num_computed_tokens == 0
    mgr.allocate_slots("r", tokens, 5, num_computed_tokens=8)
    assert mgr.get_computed_blocks("probe", tokens).num_computed_tokens == 12
