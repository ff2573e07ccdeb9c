"""The KV tier store: each tier, the hierarchy, integrity checks and faults."""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest

from ember_kv_cache import (
    BlockHasher,
    CPUTier,
    DiskTier,
    LayoutFingerprint,
    RedisTier,
    TieredKVStore,
    make_tier,
)
from ember_kv_cache.tier_entry import EntryError, decode_entry, encode_entry

FP = LayoutFingerprint("tiny-llama", "float32", 16, 2, 2, 8, chunk_size=32)


def chunk(seed: int) -> tuple[bytes, np.ndarray]:
    """A chunk's chain hash and a [layers, k/v, tokens, heads, head_size] array."""
    hasher = BlockHasher(16)
    tokens = list(range(seed, seed + 32))
    key = hasher.hash_prefix(tokens)[-1]
    return key, np.random.default_rng(seed).standard_normal((2, 2, 32, 2, 8), dtype=np.float32)


def test_fingerprint_separates_layouts_and_validates():
    assert (
        FP.digest == LayoutFingerprint("tiny-llama", "float32", 16, 2, 2, 8, chunk_size=32).digest
    )
    assert FP.digest != LayoutFingerprint("tiny-llama", "float32", 16, 2, 2, 8, tp_rank=1,
                                          chunk_size=32).digest  # fmt: skip
    # A pipeline stage past the first keys its own chunks; an unsplit layout keeps the digest it
    # had before stages were part of it, so existing stores still hit.
    stage = LayoutFingerprint("tiny-llama", "float32", 16, 2, 2, 8, chunk_size=32, first_layer=2)
    assert stage.digest != FP.digest
    unsplit = {"model": "tiny-llama", "dtype": "float32", "block_size": 16, "num_layers": 2,
               "num_kv_heads": 2, "head_size": 8, "tp_rank": 0, "chunk_size": 32,
               "hash_algo": "sha256"}  # fmt: skip
    canonical = json.dumps(unsplit, sort_keys=True).encode()
    assert FP.digest == hashlib.blake2b(canonical, digest_size=16).hexdigest()
    with pytest.raises(ValueError, match="first_layer"):
        LayoutFingerprint("m", "float32", 16, 2, 2, 8, first_layer=-1)
    with pytest.raises(ValueError, match="chunk_size"):
        LayoutFingerprint("m", "float32", 16, 2, 2, 8, chunk_size=40)
    with pytest.raises(ValueError, match="num_layers"):
        LayoutFingerprint("m", "float32", 16, 0, 2, 8)


def test_fingerprint_describes_the_per_layer_shape_of_kv_and_latent_layouts():
    assert FP.layer_shape == (2, 16, 2, 8)  # key and value per block
    assert FP.chunk_shape() == (2, 2, 32, 2, 8) and FP.chunk_shape(16) == (2, 2, 16, 2, 8)
    # Multi-head latent attention: one latent "head" per token (kv_lora_rank + rope dims).
    latent = LayoutFingerprint("tiny-ds", "float32", 16, 3, 1, 48, chunk_size=32,
                               tensors_per_layer=1)  # fmt: skip
    assert latent.layer_shape == (1, 16, 1, 48)
    assert latent.chunk_shape() == (3, 1, 32, 1, 48)
    same_but_two = LayoutFingerprint("tiny-ds", "float32", 16, 3, 1, 48, chunk_size=32)
    assert latent.digest != same_but_two.digest  # chunks of one layout never load as the other
    with pytest.raises(ValueError, match="tensors_per_layer"):
        LayoutFingerprint("m", "float32", 16, 2, 2, 8, tensors_per_layer=3)


def test_entry_round_trips_arrays_and_bytes():
    key, array = chunk(1)
    np.testing.assert_array_equal(decode_entry(encode_entry(FP, key, array), FP, key), array)
    assert decode_entry(encode_entry(FP, key, b"raw"), FP, key) == b"raw"
    with pytest.raises(ValueError, match="bytes or a numpy array"):
        encode_entry(FP, key, [1, 2])


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "other_chunk"])
def test_damaged_entries_are_rejected(damage):
    key, array = chunk(1)
    data = bytearray(encode_entry(FP, key, array))
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "foreign":
        other = LayoutFingerprint("tiny-qwen", "float32", 16, 2, 2, 8, chunk_size=32)
        data = encode_entry(other, key, array)
    else:
        data = encode_entry(FP, chunk(2)[0], array)
    with pytest.raises(EntryError) as info:
        decode_entry(bytes(data), FP, key)
    assert info.value.kind == ("foreign" if damage in ("foreign", "other_chunk") else "corrupt")


def test_cpu_tier_is_lru_under_its_byte_limit():
    tier = CPUTier(max_bytes=250)
    for name in "abc":
        tier.put(name, bytes(100))
    assert not tier.contains("a") and tier.used_bytes == 200
    tier.get("b")  # b is now newer than c
    tier.put("d", bytes(100))
    assert tier.contains("b") and not tier.contains("c") and tier.used_bytes <= 250
    tier.put("huge", bytes(1000))  # larger than the whole tier: not stored, nothing evicted
    assert not tier.contains("huge") and tier.contains("d")


def test_disk_tier_survives_restart_and_keeps_its_limit(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=350)
    for name in "abcd":
        tier.put(name, name.encode() * 100)
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert on_disk == ["b.kv", "c.kv", "d.kv"]  # no temporary files left, a evicted
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 350
    assert tier.get("b") == b"b" * 100
    reopened = DiskTier(tmp_path, max_bytes=350)
    assert reopened.used_bytes == 300 and reopened.get("c") == b"c" * 100
    smaller = DiskTier(tmp_path, max_bytes=150)  # a restart with a lower limit trims at once
    assert smaller.used_bytes <= 150 and len(list(tmp_path.iterdir())) == 1


def test_disk_tier_over_its_limit_through_the_store(tmp_path):
    key, array = chunk(1)
    entry_size = len(encode_entry(FP, key, array))
    store = TieredKVStore([DiskTier(tmp_path, max_bytes=3 * entry_size + 10)], FP)
    keys = []
    for seed in range(6):
        key, array = chunk(seed)
        store.put(key, array)
        keys.append(key)
    files = list(tmp_path.iterdir())
    assert len(files) == 3 and sum(f.stat().st_size for f in files) <= 3 * entry_size + 10
    assert [store.contains(k) for k in keys] == [False] * 3 + [True] * 3
    np.testing.assert_array_equal(store.get(keys[-1]), chunk(5)[1])


def test_hierarchy_promotes_hits_and_counts_stats(tmp_path):
    cpu, disk = CPUTier(10**6), DiskTier(tmp_path, 10**6)
    store = TieredKVStore([cpu, disk], FP)
    key, array = chunk(3)
    store.put(key, array)
    cpu.evict(FP.tier_key(key))
    np.testing.assert_array_equal(store.get(key), array)  # from disk, copied up
    assert cpu.contains(FP.tier_key(key))
    np.testing.assert_array_equal(store.get(key), array)  # from the CPU tier now
    assert store.get(chunk(4)[0]) is None
    stats = store.take_stats()
    assert (stats["cpu"].queries, stats["cpu"].hits) == (3, 1)
    assert (stats["disk"].queries, stats["disk"].hits) == (2, 1)
    size = len(encode_entry(FP, key, array))
    assert stats["disk"].bytes_loaded == size and stats["cpu"].bytes_stored == 2 * size
    assert len(stats["cpu"].load_seconds) == 1 and len(stats["disk"].store_seconds) == 1
    assert store.take_stats()["cpu"].queries == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_disk_entry_is_a_counted_miss(tmp_path, caplog, damage):
    disk = DiskTier(tmp_path, 10**6)
    store = TieredKVStore([disk], FP)
    key, array = chunk(5)
    store.put(key, array)
    file = tmp_path / (FP.tier_key(key) + ".kv")
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[200] ^= 0xFF
    elif damage == "truncate":
        data = data[:-1]
    else:
        data = encode_entry(LayoutFingerprint("other", "float32", 16, 2, 2, 8, chunk_size=32),
                            key, array)  # fmt: skip
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ember_kv_cache.tier_store"):
        assert store.get(key) is None
    assert "dropping entry" in caplog.text
    assert store.take_stats()["disk"].invalid_entries == 1
    assert not file.exists()  # removed, so the next put can replace it


def test_valid_lower_copy_serves_a_damaged_upper_one(tmp_path):
    cpu, disk = CPUTier(10**6), DiskTier(tmp_path, 10**6)
    store = TieredKVStore([cpu, disk], FP)
    key, array = chunk(6)
    store.put(key, array)
    cpu.put(FP.tier_key(key), b"garbage")
    np.testing.assert_array_equal(store.get(key), array)
    assert store.take_stats()["cpu"].invalid_entries == 1


def test_redis_tier_against_a_real_server(redis_server):
    _, url = redis_server
    store = TieredKVStore([RedisTier(url)], FP)
    key, array = chunk(7)
    assert not store.contains(key)
    store.put(key, array)
    assert store.contains(key)
    np.testing.assert_array_equal(store.get(key), array)
    store.evict(key)
    assert store.get(key) is None
    stats = store.take_stats()["redis"]
    assert (stats.queries, stats.hits, stats.errors) == (2, 1, 0)


def test_contains_many_asks_each_tier_once_for_what_is_not_found_above(tmp_path):
    class CountingDisk(DiskTier):
        def contains_many(self, keys):
            self.asked.append(list(keys))
            return super().contains_many(keys)

    disk = CountingDisk(tmp_path, 10**6)
    disk.asked = []
    store = TieredKVStore([CPUTier(10**6), disk], FP)
    (k1, a1), (k2, a2), (k3, _) = chunk(1), chunk(2), chunk(3)
    store.put(k1, a1)
    disk.put(FP.tier_key(k2), encode_entry(FP, k2, a2))  # only the lower tier has it
    assert store.contains_many([k1, k2, k3]) == [True, True, False]
    assert disk.asked == [[FP.tier_key(k2), FP.tier_key(k3)]]
    assert store.contains_many([]) == []


def test_redis_contains_many_in_one_pipeline(redis_server):
    _, url = redis_server
    tier = RedisTier(url)
    tier.put("a", b"x")
    tier.put("c", b"y")
    assert tier.contains_many(["a", "b", "c"]) == [True, False, True]
    assert tier.contains_many([]) == []


def test_redis_killed_mid_run_is_a_logged_miss(redis_server, caplog):
    process, url = redis_server
    store = TieredKVStore([CPUTier(10**6), RedisTier(url, timeout=0.5)], FP, retry_after=60)
    key, array = chunk(8)
    store.put(key, array)
    process.kill()
    process.wait()
    store.tiers[0].evict(FP.tier_key(key))
    with caplog.at_level(logging.WARNING, logger="ember_kv_cache.tier_store"):
        assert store.get(key) is None
        assert store.contains_many([key, chunk(9)[0]]) == [False, False]
        store.put(*chunk(9))  # the CPU tier still takes it; Redis is skipped
    assert "redis tier unavailable" in caplog.text
    assert store.contains(chunk(9)[0])
    assert store.take_stats()["redis"].errors == 1  # then skipped, not retried at every call


def test_make_tier_validates_its_config(tmp_path):
    assert isinstance(make_tier({"type": "disk", "path": str(tmp_path), "max_bytes": 10}), DiskTier)
    for spec, match in (
        ({"type": "tape"}, "tier type"),
        ({"type": "cpu"}, "max_bytes"),
        ({"type": "cpu", "max_bytes": -1}, "max_bytes"),
        ({"type": "cpu", "max_bytes": 1, "size": 2}, "unknown keys"),
        ({"type": "disk", "max_bytes": 10}, "path"),
        ({"type": "redis", "url": "http://x"}, "redis:// URL"),
        ("cpu", "must be a dict"),
    ):
        with pytest.raises(ValueError, match=match):
            make_tier(spec)
