"""KV connector keys and hits for models with several layer groups or a sliding window."""

from __future__ import annotations

import numpy as np
import pytest

from ember_kv_cache import (
    BlockHasher,
    CPUTier,
    FullAttentionSpec,
    KVTransferConfig,
    LayoutFingerprint,
    SlidingWindowSpec,
    StateSpec,
    TieredConnectorScheduler,
    TieredKVStore,
)
from ember_kv_cache.group_chunks import (
    check_connector_specs,
    describe_groups,
    group_chunk_hash,
    group_hit_holds,
)

BLOCK, CHUNK = 4, 8
WINDOW = SlidingWindowSpec(6)  # a query reads itself and 5 tokens before: 2 or 3 blocks
SPECS = (WINDOW, FullAttentionSpec())
FP = LayoutFingerprint("m", "float32", BLOCK, 1, 1, 2, chunk_size=CHUNK)


def connector(specs=SPECS) -> TieredConnectorScheduler:
    cfg = KVTransferConfig.from_dict(
        {
            "kv_connector": "TieredConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_size": CHUNK,
                "tiers": [{"type": "cpu", "max_bytes": 10**6}],
            },
        }
    )
    store = TieredKVStore([CPUTier(10**6)], FP)
    return TieredConnectorScheduler(cfg, store, BlockHasher(BLOCK), specs)


def chunk_hashes(tokens):
    return BlockHasher(BLOCK).hash_prefix(tokens)[CHUNK // BLOCK - 1 :: CHUNK // BLOCK]


def test_group_keys_keep_group_zero_plain_and_differ_per_group():
    chunk = b"\x01" * 16
    keys = [group_chunk_hash(chunk, g) for g in range(3)]
    assert keys[0] == chunk and len(set(keys)) == 3
    assert FP.tier_key(keys[1]) != FP.tier_key(keys[0])
    with pytest.raises(ValueError, match="group must be an int"):
        group_chunk_hash(chunk, -1)


def test_the_fingerprint_names_the_groups_and_keeps_full_attention_digests():
    plain = LayoutFingerprint("m", "float32", BLOCK, 1, 1, 2, chunk_size=CHUNK)
    assert describe_groups([FullAttentionSpec()]) == ""
    grouped = LayoutFingerprint(
        "m", "float32", BLOCK, 1, 1, 2, chunk_size=CHUNK, kv_groups=describe_groups(SPECS)
    )
    assert plain.digest == FP.digest != grouped.digest
    wider = describe_groups((SlidingWindowSpec(7), FullAttentionSpec()))
    assert LayoutFingerprint("m", "float32", BLOCK, 1, 1, 2, chunk_size=CHUNK, kv_groups=wider).digest != grouped.digest  # fmt: skip


def test_a_state_group_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_transfer_config"):
        check_connector_specs([FullAttentionSpec(), StateSpec()])


def test_a_window_group_needs_only_its_tail_a_full_group_every_block():
    held = np.zeros((2, 8), dtype=bool)
    held[0, 5:8] = True  # the window group: blocks 5..7 only
    held[1, :8] = True
    # Ending at block 8 (32 tokens) the window reads tokens 27..31: blocks 6 and 7.
    assert group_hit_holds(SPECS, BLOCK, held, 0, 8)
    held[0, 6] = False
    assert not group_hit_holds(SPECS, BLOCK, held, 0, 8)
    held[0, 6] = True
    held[1, 2] = False  # a full group misses a block past the local hit
    assert not group_hit_holds(SPECS, BLOCK, held, 0, 8)
    assert group_hit_holds(SPECS, BLOCK, held, 3, 8)  # ... that the local hit holds


def test_a_lookup_reads_the_window_groups_tail_chunks_only():
    conn = connector()
    tokens = list(range(1, 34))  # 4 whole chunks, the last token left to compute
    hashes = chunk_hashes(tokens)
    value = np.zeros(FP.chunk_shape(), dtype=np.float32)
    for h in hashes:
        conn.store.put(group_chunk_hash(h, 1), value)
    conn.store.put(group_chunk_hash(hashes[3], 0), value)  # the window group's last chunk only
    assert conn.get_num_new_matched_tokens("r", tokens, 0) == (32, True)
    conn.update_state_after_alloc("r", (list(range(1, 9)), list(range(9, 17))), 32)
    window, full = conn.build_connector_meta([], lambda r: ()).loads
    assert (window.group, full.group) == (0, 1)
    assert window.chunk_hashes == [b"", b"", b"", group_chunk_hash(hashes[3], 0)]
    assert full.chunk_hashes == [group_chunk_hash(h, 1) for h in hashes]
    assert window.block_ids == list(range(1, 9)) and full.block_ids == list(range(9, 17))


def test_a_missing_window_tail_shortens_the_hit():
    conn = connector()
    tokens = list(range(1, 34))
    hashes = chunk_hashes(tokens)
    value = np.zeros(FP.chunk_shape(), dtype=np.float32)
    for h in hashes:
        conn.store.put(group_chunk_hash(h, 1), value)
    conn.store.put(group_chunk_hash(hashes[1], 0), value)
    # Chunk 3's window tail is missing, chunk 2's too: the hit ends after chunk 1.
    assert conn.get_num_new_matched_tokens("r", tokens, 0) == (16, True)


def test_a_window_groups_save_keeps_what_it_still_holds():
    conn = connector()
    tokens = list(range(1, 34))
    conn.get_num_new_matched_tokens("r", tokens, 0)
    # The window group freed blocks 0..2 (the null block 0 in their place).
    tables = ([0, 0, 0, 4, 5, 6, 7, 8], list(range(9, 17)))
    saves = conn.build_connector_meta([("r", tokens, 32)], lambda r: tables).saves
    hashes = chunk_hashes(tokens)
    window = [s for s in saves if s.group == 0]
    full = [s for s in saves if s.group == 1]
    # Chunk 0 holds nothing: not saved; chunk 1 its tail block; chunks 2 and 3 whole.
    assert [(s.first_chunk, s.skip_tokens, len(s.chunk_hashes)) for s in window] == [
        (1, BLOCK, 1),
        (2, 0, 2),
    ]
    assert window[0].chunk_hashes == [group_chunk_hash(hashes[1], 0)]
    assert [(s.first_chunk, s.chunk_hashes) for s in full] == [
        (0, [group_chunk_hash(h, 1) for h in hashes])
    ]


def test_a_finished_partial_chunk_is_saved_per_group_unless_a_group_kept_none():
    conn = connector()
    tokens = list(range(1, 14))  # 3 whole blocks: chunk 1 partial with 1 block
    conn.get_num_new_matched_tokens("r", tokens, 0)
    delay, _ = conn.request_finished("r", tokens, 13, ([0, 2, 3], [4, 5, 6]))
    saves = conn.build_connector_meta([], lambda r: ()).saves
    assert delay and [(s.group, s.partial_blocks, s.stored_blocks) for s in saves] == [
        (0, 1, 1),
        (1, 1, 1),
    ]
    conn.get_num_new_matched_tokens("q", tokens, 0)
    delay, _ = conn.request_finished("q", tokens, 13, ([0, 0, 0], [4, 5, 6]))
    assert not delay and not conn.build_connector_meta([], lambda r: ()).saves
