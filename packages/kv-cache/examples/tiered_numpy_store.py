"""Another engine sharing KV chunks through the tier store, with numpy arrays.

Engine A computes the KV of a long prompt chunk by chunk and stores each chunk under its chain
hash; engine B, with a store of its own over the same disk directory (another process would do
the same), finds the prompt's chunks there and computes only the tail.

Run: python3 examples/tiered_numpy_store.py
"""

from __future__ import annotations

import tempfile

import numpy as np

from ember_kv_cache import BlockHasher, CPUTier, DiskTier, LayoutFingerprint, TieredKVStore

BLOCK, CHUNK, LAYERS, HEADS, HEAD_SIZE = 16, 64, 2, 2, 8
fingerprint = LayoutFingerprint("toy-model", "float32", BLOCK, LAYERS, HEADS, HEAD_SIZE,
                                chunk_size=CHUNK)  # fmt: skip
hasher = BlockHasher(BLOCK)


def compute_kv(token_ids: list[int], start: int) -> np.ndarray:
    """Stand-in for a forward pass: [layers, k/v, tokens, heads, head_size]."""
    positions = np.arange(start, start + len(token_ids), dtype=np.float32)
    values = np.asarray(token_ids, dtype=np.float32) + positions / 1000
    return np.broadcast_to(values[None, None, :, None, None],
                           (LAYERS, 2, len(token_ids), HEADS, HEAD_SIZE)).copy()  # fmt: skip


def chunk_hashes(token_ids: list[int]) -> list[bytes]:
    """The chain hash of each whole chunk's last block."""
    block_hashes = hasher.hash_prefix(token_ids)
    per_chunk = CHUNK // BLOCK
    return block_hashes[per_chunk - 1 :: per_chunk]


def serve(store: TieredKVStore, token_ids: list[int]) -> tuple[np.ndarray, int]:
    """The prompt's KV, loading leading chunks from the store; returns it and tokens computed."""
    parts, loaded = [], 0
    for chunk_hash in chunk_hashes(token_ids):
        kv = store.get(chunk_hash)
        if kv is None:
            break
        parts.append(kv)
        loaded += CHUNK
    parts.append(compute_kv(token_ids[loaded:], loaded))
    for index, chunk_hash in enumerate(chunk_hashes(token_ids)[loaded // CHUNK :]):
        start = loaded + index * CHUNK
        store.put(chunk_hash, np.concatenate(parts, axis=2)[:, :, start : start + CHUNK])
    return np.concatenate(parts, axis=2), len(token_ids) - loaded


prompt = [(7 * i) % 500 for i in range(300)]
with tempfile.TemporaryDirectory() as directory:
    engine_a = TieredKVStore([CPUTier(1 << 20), DiskTier(directory, 1 << 20)], fingerprint)
    kv_a, computed_a = serve(engine_a, prompt)
    engine_b = TieredKVStore([CPUTier(1 << 20), DiskTier(directory, 1 << 20)], fingerprint)
    kv_b, computed_b = serve(engine_b, prompt)
    assert np.array_equal(kv_a, kv_b)
    disk = engine_b.take_stats()["disk"]
    print(f"engine A computed {computed_a} of {len(prompt)} tokens")
    print(f"engine B computed {computed_b} of {len(prompt)} tokens, "
          f"loaded {disk.hits} chunks ({disk.bytes_loaded} bytes) from disk")  # fmt: skip
