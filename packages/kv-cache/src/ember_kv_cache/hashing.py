"""Chained prefix-cache block hashes over a canonical byte encoding.

``hash(block i) = H(hash(block i-1) || encode(token ids of block i) || encode(extra keys of i))``
with ``hash(block -1) = H(seed)``. The encoding is fixed (little-endian uint32 token ids,
length-prefixed UTF-8 strings), so hashes agree across processes and machines; Python's ``hash()``
is never used.
"""

from __future__ import annotations

import array
import functools
import hashlib
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

HASH_ALGOS = ("sha256", "xxhash64", "xxhash128")
# The chain hash's algorithm when none is chosen: every component that hashes or keys blocks
# (the scheduler's prefix cache, the connector's layout fingerprint) defaults to this one.
DEFAULT_HASH_ALGO = "sha256"

# An extra key is ("lora", name), ("mm", identifier, offset) or ("salt", salt).
ExtraKey = tuple
_U32 = struct.Struct("<I")
# The array typecode of a 4-byte unsigned int ("I" on every platform CPython supports today).
_U32_CODE = next(code for code in "ILH" if array.array(code).itemsize == 4)
_I64 = struct.Struct("<q")


@dataclass(frozen=True)
class MultiModalItem:
    """A multimodal input (an image, an audio clip) occupying ``length`` placeholder tokens.

    ``identifier`` names the item's content (for example a hash of its pixels), so that two
    prompts with the same placeholder tokens but different images never share a cached block.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError("MultiModalItem.identifier must be a non-empty string")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"MultiModalItem.offset must be an int >= 0, got {self.offset!r}")
        if not isinstance(self.length, int) or self.length <= 0:
            raise ValueError(f"MultiModalItem.length must be an int > 0, got {self.length!r}")


@dataclass(frozen=True)
class BlockHashExtras:
    """What besides token ids decides whether two requests may share a cached block.

    ``lora_name`` enters every block's hash, each multimodal item enters the hash of every block
    its placeholder tokens overlap, and ``cache_salt`` enters the first block's hash only (which,
    through the chain, separates every later block too).
    """

    lora_name: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.lora_name is not None and not isinstance(self.lora_name, str):
            raise ValueError(f"BlockHashExtras.lora_name must be a str, got {self.lora_name!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"BlockHashExtras.cache_salt must be a str, got {self.cache_salt!r}")
        items = tuple(self.mm_items)
        if not all(isinstance(item, MultiModalItem) for item in items):
            raise ValueError("BlockHashExtras.mm_items must hold MultiModalItem objects")
        object.__setattr__(self, "mm_items", items)
        lora_keys = (("lora", self.lora_name),) if self.lora_name is not None else ()
        object.__setattr__(self, "_lora_keys", lora_keys)

    def block_extra_keys(self, block_index: int, block_size: int) -> tuple[ExtraKey, ...]:
        """The extra keys that enter the hash of block ``block_index``."""
        if not self.mm_items and block_index:
            return self._lora_keys
        keys = list(self._lora_keys)
        start = block_index * block_size
        end = start + block_size
        for item in self.mm_items:
            if item.offset < end and item.offset + item.length > start:
                keys.append(("mm", item.identifier, item.offset))
        if block_index == 0 and self.cache_salt is not None:
            keys.append(("salt", self.cache_salt))
        return tuple(keys)


@functools.lru_cache(maxsize=4096)
def encode_extra_keys(keys: tuple[ExtraKey, ...]) -> bytes:
    """Canonical bytes of a block's extra keys: a tag byte, then length-prefixed fields.

    Cached: the same adapter or salt recurs in block after block.
    """
    parts: list[bytes] = []
    for key in keys:
        kind = key[0]
        if kind == "lora":
            parts.append(b"L" + _encode_str(key[1]))
        elif kind == "mm":
            parts.append(b"M" + _encode_str(key[1]) + _I64.pack(key[2]))
        elif kind == "salt":
            parts.append(b"S" + _encode_str(key[1]))
        else:
            raise ValueError(f"unknown extra key kind {kind!r}")
    return b"".join(parts)


def _encode_str(text: str) -> bytes:
    data = text.encode("utf-8")
    return _U32.pack(len(data)) + data


def get_hash_function(algo: str) -> Callable[[bytes], bytes]:
    """The digest function for ``algo`` (one of ``HASH_ALGOS``)."""
    if algo == "sha256":
        return _sha256
    if algo in ("xxhash64", "xxhash128"):
        try:
            import xxhash
        except ImportError as exc:
            raise ImportError(
                f"hash_algo={algo!r} needs the optional xxhash package; install it with "
                "pip install 'ember-kv-cache[xxhash]'"
            ) from exc
        return xxhash.xxh3_64_digest if algo == "xxhash64" else xxhash.xxh3_128_digest
    raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class BlockHasher:
    """Chained hashes of full blocks of ``block_size`` tokens, for one algorithm and seed.

    Two hashers with the same ``block_size``, ``algo`` and ``seed`` give the same hashes in any
    process on any machine.
    """

    def __init__(self, block_size: int, algo: str = DEFAULT_HASH_ALGO, seed: bytes = b"") -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(seed, bytes):
            raise ValueError(f"hash_seed must be bytes, got {type(seed).__name__}")
        self.block_size = block_size
        self.algo = algo
        self._digest = get_hash_function(algo)
        self._token_count_prefix = _U32.pack(block_size)
        self.root_hash: bytes = self._digest(b"ember-kv-cache/root" + _U32.pack(len(seed)) + seed)

    def hash_block(
        self,
        parent_hash: bytes,
        token_ids: Sequence[int],
        extra_keys: Sequence[ExtraKey] = (),
    ) -> bytes:
        """Hash of one full block given its parent's hash (``root_hash`` for the first block)."""
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"a block holds exactly {self.block_size} token ids, got {len(token_ids)}"
            )
        extra = encode_extra_keys(tuple(extra_keys)) if extra_keys else b""
        return self._digest(parent_hash + self._token_count_prefix + _pack(token_ids) + extra)

    def chain(
        self,
        token_ids: Sequence[int],
        num_blocks: int | None = None,
        *,
        first_block: int = 0,
        parent_hash: bytes | None = None,
        extras: BlockHashExtras | None = None,
    ) -> Iterator[bytes]:
        """Hashes of the full blocks ``first_block``, ``first_block + 1``, ... of ``token_ids``
        (``num_blocks`` of them, default every full block), chained from ``parent_hash`` (block
        ``first_block - 1``'s hash; the root hash by default); the same as ``hash_block`` one
        block at a time, with the token ids packed once for all the blocks. Lazy: a lookup that
        stops at its first miss hashes no further."""
        size = self.block_size
        if num_blocks is None:
            num_blocks = len(token_ids) // size - first_block
        if num_blocks <= 0:
            return
        data = _pack(token_ids[first_block * size : (first_block + num_blocks) * size])
        if len(data) != 4 * size * num_blocks:
            raise ValueError(f"token_ids hold fewer than {first_block + num_blocks} full blocks")
        parent = self.root_hash if parent_hash is None else parent_hash
        digest, prefix, step = self._digest, self._token_count_prefix, 4 * size
        for i in range(num_blocks):
            extra = b""
            if extras is not None:
                keys = extras.block_extra_keys(first_block + i, size)
                extra = encode_extra_keys(keys) if keys else b""
            parent = digest(parent + prefix + data[i * step : (i + 1) * step] + extra)
            yield parent

    def hash_prefix(
        self,
        token_ids: Sequence[int],
        extras: BlockHashExtras | None = None,
        num_blocks: int | None = None,
    ) -> list[bytes]:
        """Hashes of the first ``num_blocks`` full blocks of ``token_ids`` (all full blocks by
        default), computed from scratch."""
        return list(self.chain(token_ids, num_blocks, extras=extras))


def _pack(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32 bytes of ``token_ids``; ValueError for any id outside [0, 2**32)."""
    try:
        packed = array.array(_U32_CODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token_ids must be ints in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()
