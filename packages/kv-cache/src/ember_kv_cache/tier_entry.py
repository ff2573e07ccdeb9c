"""The layout fingerprint that keys tier entries, and the self-checking entry format.

An entry is ``MAGIC | checksum id | u32 header length | JSON header | payload | checksum`` where
the checksum, a 128-bit digest of all before it, is xxh3-128 when the ``xxhash`` extra is
installed (about ten times faster) and blake2b-128 otherwise.
The header names the fingerprint and chunk hash the entry was written for, and the payload's
dtype and shape (absent for plain bytes). Reading checks the digest first, so a flipped byte or
a truncated file anywhere is caught before anything is parsed; then it checks that the entry
belongs to this layout and chunk. A failed check is an ``EntryError`` whose ``kind`` says which.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field

import numpy as np

from ember_kv_cache.hashing import DEFAULT_HASH_ALGO

MAGIC = b"EMKV1"
_U32 = struct.Struct("<I")
_DIGEST_SIZE = 16
_PREFIX_SIZE = len(MAGIC) + 1 + _U32.size


def _blake2b():
    return hashlib.blake2b(digest_size=_DIGEST_SIZE)


try:
    from xxhash import xxh3_128
except ImportError:
    xxh3_128 = None

# Checksum id in the entry -> a new digest object (None: not installed here).
_CHECKSUMS = {0: _blake2b, 1: xxh3_128}
_WRITE_CHECKSUM = 0 if xxh3_128 is None else 1


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that must match for a stored KV chunk to be valid in another engine.

    ``model`` names the weights (a path, a hub id or a digest of the config); ``chunk_size`` is
    in tokens and ``hash_algo`` is the chain hash's algorithm, since both decide what a key means.
    A shard holds ``num_layers`` layers from ``first_layer`` on (a pipeline stage after the
    first starts past 0) and the KV heads of tensor-parallel rank ``tp_rank``.

    Each layer keeps ``tensors_per_layer`` tensors of ``layer_shape`` per block: 2 for a key and
    a value (``[block_size, num_kv_heads, head_size]`` each), 1 for a cache read as both, such
    as multi-head latent attention's one latent "head" of ``kv_lora_rank + qk_rope_head_dim``
    values per token. A stored chunk is an array of ``chunk_shape``.

    ``kv_groups`` names the layer groups' specs where they are not one group of full attention
    (``group_chunks.describe_groups``): then ``num_layers`` are one group's, the layers that
    share a block, and each group stores its own entry per chunk.
    """

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_rank: int = 0
    chunk_size: int = 256
    hash_algo: str = DEFAULT_HASH_ALGO
    first_layer: int = 0
    tensors_per_layer: int = 2
    kv_groups: str = ""
    # Set from the fields above: two fingerprints match iff their digests do.
    digest: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"LayoutFingerprint.model must be a non-empty str, got {self.model!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"LayoutFingerprint.dtype must be a non-empty str, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LayoutFingerprint.{name} must be a positive int, got {value!r}")
        for name in ("tp_rank", "first_layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"LayoutFingerprint.{name} must be an int >= 0, got {value!r}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must be a multiple of block_size "
                f"({self.block_size})"
            )
        if not isinstance(self.kv_groups, str):
            raise ValueError(f"LayoutFingerprint.kv_groups must be a str, got {self.kv_groups!r}")
        if self.tensors_per_layer not in (1, 2):
            raise ValueError(
                f"LayoutFingerprint.tensors_per_layer must be 1 or 2, got {self.tensors_per_layer!r}"
            )
        fields = {k: v for k, v in asdict(self).items() if k != "digest"}
        # Fields at their first default are left out: the digests written before they existed
        # stay what they were.
        if not self.first_layer:
            del fields["first_layer"]
        if self.tensors_per_layer == 2:
            del fields["tensors_per_layer"]
        if not self.kv_groups:
            del fields["kv_groups"]
        canonical = json.dumps(fields, sort_keys=True).encode()
        object.__setattr__(self, "digest", hashlib.blake2b(canonical, digest_size=16).hexdigest())

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """One layer's cache per block: ``(tensors_per_layer, block_size, num_kv_heads,
        head_size)``."""
        return (self.tensors_per_layer, self.block_size, self.num_kv_heads, self.head_size)

    def chunk_shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int, int]:
        """A stored chunk of ``num_tokens`` (default: ``chunk_size``) tokens: ``(num_layers,
        tensors_per_layer, num_tokens, num_kv_heads, head_size)``."""
        tokens = self.chunk_size if num_tokens is None else num_tokens
        return (self.num_layers, self.tensors_per_layer, tokens, self.num_kv_heads, self.head_size)

    def tier_key(self, chunk_hash: bytes) -> str:
        """The name under which a chunk is stored in every tier."""
        return f"{self.digest}-{chunk_hash.hex()}"


class EntryError(Exception):
    """A stored entry that must not be used: ``kind`` is "corrupt" (digest or format) or
    "foreign" (written for another layout or chunk)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def encode_entry(
    fingerprint: LayoutFingerprint, chunk_hash: bytes, value: bytes | np.ndarray
) -> bytes:
    """The stored bytes of one chunk: header, payload and digest."""
    header: dict = {"fingerprint": fingerprint.digest, "chunk": chunk_hash.hex()}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise ValueError("a stored array must hold plain numbers, not Python objects")
        header["dtype"] = value.dtype.str
        header["shape"] = list(value.shape)
        payload = memoryview(np.ascontiguousarray(value)).cast("B")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        payload = value
    else:
        raise ValueError(
            f"a stored value must be bytes or a numpy array, got {type(value).__name__}"
        )
    header_bytes = json.dumps(header).encode()
    prefix = MAGIC + bytes((_WRITE_CHECKSUM,)) + _U32.pack(len(header_bytes))
    digest = _CHECKSUMS[_WRITE_CHECKSUM]()
    for part in (prefix, header_bytes, payload):
        digest.update(part)
    return b"".join((prefix, header_bytes, payload, digest.digest()))


def decode_entry(
    data: bytes, fingerprint: LayoutFingerprint, chunk_hash: bytes
) -> bytes | np.ndarray:
    """The value stored in ``data``; ``EntryError`` if it is damaged or not this chunk's."""
    if len(data) < _PREFIX_SIZE + _DIGEST_SIZE or not data.startswith(MAGIC):
        raise EntryError("corrupt", "entry is too short or lacks the ember KV magic")
    checksum = _CHECKSUMS.get(data[len(MAGIC)])
    if checksum is None:
        raise EntryError(
            "foreign",
            "entry has a checksum this process cannot compute "
            "(xxh3-128: pip install 'ember-kv-cache[xxhash]')",
        )
    view = memoryview(data)
    body = view[:-_DIGEST_SIZE]
    digest = checksum()
    digest.update(body)
    if digest.digest() != data[-_DIGEST_SIZE:]:
        raise EntryError("corrupt", "entry checksum mismatch (damaged or truncated)")
    start = _PREFIX_SIZE
    (header_len,) = _U32.unpack_from(data, len(MAGIC) + 1)
    try:
        header = json.loads(bytes(body[start : start + header_len]))
    except ValueError as exc:
        raise EntryError("corrupt", f"entry header is not JSON: {exc}") from None
    if header.get("fingerprint") != fingerprint.digest or header.get("chunk") != chunk_hash.hex():
        raise EntryError("foreign", "entry was written for another layout or chunk")
    payload = body[start + header_len :]
    if "dtype" not in header:
        return bytes(payload)
    try:
        return np.frombuffer(payload, dtype=np.dtype(header["dtype"])).reshape(header["shape"])
    except (TypeError, ValueError) as exc:
        raise EntryError("corrupt", f"entry payload does not match its header: {exc}") from None
