"""Chained block hashes: canonical encoding, seeds, extra keys and the hash choices."""

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from ember_kv_cache import BlockHasher, BlockHashExtras, KVCacheManager, MultiModalItem


def test_sha256_hash_is_the_documented_canonical_encoding():
    hasher = BlockHasher(4)
    root = hashlib.sha256(b"ember-kv-cache/root" + struct.pack("<I", 0)).digest()
    assert hasher.root_hash == root
    expected = hashlib.sha256(root + struct.pack("<I", 4) + struct.pack("<4I", 1, 2, 3, 70000))
    assert hasher.hash_block(root, [1, 2, 3, 70000]) == expected.digest()
    lora = b"L" + struct.pack("<I", 3) + b"sql"
    expected = hashlib.sha256(root + struct.pack("<I", 4) + struct.pack("<4I", 1, 2, 3, 4) + lora)
    assert hasher.hash_block(root, [1, 2, 3, 4], [("lora", "sql")]) == expected.digest()


def test_hashes_are_stable_across_processes():
    code = (
        "from ember_kv_cache import BlockHasher;"
        "print(BlockHasher(4, seed=b'x').hash_prefix(list(range(12)))[-1].hex())"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert runs == {BlockHasher(4, seed=b"x").hash_prefix(list(range(12)))[-1].hex()}


def test_seed_sets_the_first_parent_and_chains_through():
    a, b, a2 = BlockHasher(4, seed=b"a"), BlockHasher(4, seed=b"b"), BlockHasher(4, seed=b"a")
    tokens = list(range(8))
    assert a.hash_prefix(tokens) == a2.hash_prefix(tokens)
    assert set(a.hash_prefix(tokens)).isdisjoint(b.hash_prefix(tokens))


def test_managers_with_the_same_seed_share_hashes():
    tokens = list(range(9))
    hashes = []
    for _ in range(2):
        mgr = KVCacheManager(8, 4, hash_seed=b"fleet")
        mgr.allocate_slots("a", tokens, 9)
        hashes.append(set(mgr.block_pool.cached_block_hash_to_block))
    assert hashes[0] == hashes[1] and len(hashes[0]) == 2


def test_chain_depends_on_every_earlier_block():
    hasher = BlockHasher(2)
    first = hasher.hash_prefix([1, 2, 3, 4])
    second = hasher.hash_prefix([9, 2, 3, 4])
    assert first[1] != second[1]
    assert hasher.hash_prefix([1, 2, 3, 4, 5]) == first  # the partial block is not hashed


def test_chain_equals_hashing_one_block_at_a_time():
    """From the root or from a block in the middle, with extras; and lazily."""
    hasher = BlockHasher(4, seed=b"s")
    extras = BlockHashExtras(lora_name="sql", mm_items=(MultiModalItem("img", 5, 6),))
    tokens = [7, 70000, *range(20, 42)]  # 6 full blocks
    one_by_one, parent = [], hasher.root_hash
    for index in range(6):
        keys = extras.block_extra_keys(index, 4)
        parent = hasher.hash_block(parent, tokens[4 * index : 4 * index + 4], keys)
        one_by_one.append(parent)
    assert list(hasher.chain(tokens, extras=extras)) == one_by_one
    middle = hasher.chain(tokens, 3, first_block=2, parent_hash=one_by_one[1], extras=extras)
    assert list(middle) == one_by_one[2:5]
    assert list(hasher.chain(tokens, 0)) == []
    lazy = hasher.chain(tokens + [-1] * 4)  # a bad id anywhere is refused before any hash
    with pytest.raises(ValueError, match="token_ids"):
        next(lazy)
    with pytest.raises(ValueError, match="full blocks"):
        next(hasher.chain(tokens, 7))


def test_extra_keys_per_block():
    extras = BlockHashExtras(
        lora_name="sql",
        mm_items=(MultiModalItem("img-a", 3, 4), MultiModalItem("img-b", 9, 1)),
        cache_salt="tenant",
    )
    keys = [extras.block_extra_keys(i, 4) for i in range(3)]
    assert keys[0] == (("lora", "sql"), ("mm", "img-a", 3), ("salt", "tenant"))
    assert keys[1] == (("lora", "sql"), ("mm", "img-a", 3))
    assert keys[2] == (("lora", "sql"), ("mm", "img-b", 9))


def test_each_extra_changes_the_hashes():
    hasher = BlockHasher(4)
    tokens = list(range(8))
    plain = hasher.hash_prefix(tokens)
    variants = [
        BlockHashExtras(lora_name="a"),
        BlockHashExtras(cache_salt="s"),
        BlockHashExtras(mm_items=[MultiModalItem("img", 5, 2)]),
        BlockHashExtras(mm_items=[MultiModalItem("other", 5, 2)]),
    ]
    results = [hasher.hash_prefix(tokens, extras) for extras in variants]
    for hashes in results:
        assert hashes[1] != plain[1]
    assert len({hashes[1] for hashes in results}) == len(results)
    # An item in the second block leaves the first block's hash alone.
    assert results[2][0] == plain[0]


@pytest.mark.parametrize(("algo", "size"), [("sha256", 32), ("xxhash64", 8), ("xxhash128", 16)])
def test_hash_algorithms(algo, size):
    hasher = BlockHasher(4, algo)
    hashes = hasher.hash_prefix(list(range(12)))
    assert [len(h) for h in hashes] == [size] * 3
    assert len(set(hashes)) == 3
    assert BlockHasher(4, algo).hash_prefix(list(range(12))) == hashes


def test_missing_xxhash_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ImportError, match=r"ember-kv-cache\[xxhash\]"):
        KVCacheManager(8, 4, hash_algo="xxhash64")


@pytest.mark.parametrize("bad", [[1, 2, 3, -1], [1, 2, 3, 2**32], [1, 2, 3, 1.5]])
def test_bad_token_ids(bad):
    with pytest.raises(ValueError, match="token_ids"):
        BlockHasher(4).hash_block(b"", bad)
    with pytest.raises(ValueError, match="token_ids"):
        BlockHasher(4).hash_prefix([5, 6, 7, 8, *bad])


def test_bad_extras():
    with pytest.raises(ValueError, match="lora_name"):
        BlockHashExtras(lora_name=3)
    with pytest.raises(ValueError, match="offset"):
        MultiModalItem("img", -1, 2)
    with pytest.raises(ValueError, match="length"):
        MultiModalItem("img", 0, 0)
    with pytest.raises(ValueError, match="mm_items"):
        BlockHashExtras(mm_items=["img"])
    with pytest.raises(ValueError, match="extras"):
        KVCacheManager(8, 4).get_computed_blocks("a", [1, 2], extras={"lora_name": "x"})


def test_block_of_the_wrong_length():
    with pytest.raises(ValueError, match="exactly 4"):
        BlockHasher(4).hash_block(b"", [1, 2, 3])
