"""Storage tiers for KV chunks: process memory, a local directory, a Redis server.

A tier stores opaque entries (``tier_entry`` makes and checks them) under string keys. Each is
safe to use from several threads. A tier whose backend fails (a disk error, Redis gone) raises
``TierUnavailable``; ``TieredKVStore`` turns that into a miss.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

TIER_TYPES = ("cpu", "disk", "redis")


class TierUnavailable(Exception):
    """The tier's backend failed; the operation did nothing."""


class KVTier(Protocol):
    """What ``TieredKVStore`` needs of a tier."""

    name: str

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def contains(self, key: str) -> bool: ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, in one round trip where the backend allows."""
        ...

    def evict(self, key: str) -> None: ...

    def close(self) -> None: ...


class _LRUBytes:
    """Sizes of entries in least-recently-used order, and which to drop to stay in a limit."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.sizes: OrderedDict[str, int] = OrderedDict()

    def add(self, key: str, size: int) -> list[str]:
        """Record ``key`` as newest; returns the keys to drop, oldest first."""
        self.remove(key)
        self.sizes[key] = size
        self.used_bytes += size
        victims = []
        while self.used_bytes > self.max_bytes:
            victim, victim_size = self.sizes.popitem(last=False)
            self.used_bytes -= victim_size
            victims.append(victim)
        return victims

    def remove(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size


def _check_max_bytes(tier: str, max_bytes: object) -> int:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"{tier} tier: max_bytes must be a positive int, got {max_bytes!r}")
    return max_bytes


class CPUTier:
    """Entries in this process's memory, least recently used dropped past ``max_bytes``."""

    name = "cpu"

    def __init__(self, max_bytes: int) -> None:
        self._lru = _LRUBytes(_check_max_bytes("cpu", max_bytes))
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self._lru.sizes.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self._lru.max_bytes:
            return  # would evict everything and still not fit
        with self._lock:
            self._data[key] = data
            for victim in self._lru.add(key, len(data)):
                del self._data[victim]

    def contains(self, key: str) -> bool:
        return key in self._data

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._data for key in keys]

    def evict(self, key: str) -> None:
        with self._lock:
            self._lru.remove(key)
            self._data.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._lru = _LRUBytes(self._lru.max_bytes)


class DiskTier:
    """One file per entry in ``path``, written to a temporary file and renamed into place (a
    reader sees a whole entry or none), least recently used removed past ``max_bytes``.

    Entries survive restarts: at start the tier indexes the files already there, oldest
    modification first, and a hit refreshes the file's modification time. Several processes may
    share the directory; each keeps the limit over the files it has seen.
    """

    name = "disk"
    SUFFIX = ".kv"

    def __init__(self, path: str | os.PathLike, max_bytes: int) -> None:
        self._lru = _LRUBytes(_check_max_bytes("disk", max_bytes))
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"disk tier: cannot use path {str(path)!r}: {exc}") from None
        self._lock = threading.Lock()
        existing = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(self.SUFFIX) and entry.is_file():
                stat = entry.stat()
                existing.append((stat.st_mtime_ns, entry.name[: -len(self.SUFFIX)], stat.st_size))
        for _, key, size in sorted(existing):
            self._drop_files(self._lru.add(key, size))

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def _file(self, key: str) -> Path:
        return self.path / (key + self.SUFFIX)

    def get(self, key: str) -> bytes | None:
        file = self._file(key)
        try:
            data = file.read_bytes()
            os.utime(file)
        except FileNotFoundError:
            with self._lock:
                self._lru.remove(key)  # removed by another process sharing the directory
            return None
        except OSError as exc:
            raise TierUnavailable(f"disk tier: cannot read {file}: {exc}") from exc
        with self._lock:
            self._drop_files(self._lru.add(key, len(data)))
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self._lru.max_bytes:
            return
        file = self._file(key)
        temp = self.path / f".{key}.{uuid.uuid4().hex}.tmp"
        try:
            temp.write_bytes(data)
            os.replace(temp, file)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise TierUnavailable(f"disk tier: cannot write {file}: {exc}") from exc
        with self._lock:
            self._drop_files(self._lru.add(key, len(data)))

    def contains(self, key: str) -> bool:
        return self._file(key).is_file()

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self._file(key).is_file() for key in keys]

    def evict(self, key: str) -> None:
        with self._lock:
            self._lru.remove(key)
            self._drop_files([key])

    def _drop_files(self, keys: list[str]) -> None:
        for key in keys:
            self._file(key).unlink(missing_ok=True)

    def close(self) -> None:
        pass  # every entry is already on disk


class RedisTier:
    """Entries as Redis strings under ``key_prefix``. The server's own ``maxmemory`` and
    eviction policy (``allkeys-lru``) bound its size. Needs the ``redis`` extra."""

    name = "redis"

    def __init__(self, url: str, key_prefix: str = "ember:kv:", timeout: float = 2.0) -> None:
        try:
            import redis
        except ImportError as exc:
            raise ImportError(
                "the Redis tier needs the redis package; install it with "
                "pip install 'ember-kv-cache[redis]'"
            ) from exc
        check_tier_spec({"type": "redis", "url": url})
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self.url = url
        self.key_prefix = key_prefix

    def _call(self, method: str, *args, client=None):
        """``method`` of ``client`` (default: the connection), a backend failure as
        ``TierUnavailable``."""
        try:
            return getattr(client or self._client, method)(*args)
        except self._errors as exc:
            raise TierUnavailable(f"redis tier ({self.url}): {exc}") from exc

    def get(self, key: str) -> bytes | None:
        return self._call("get", self.key_prefix + key)

    def put(self, key: str, data: bytes) -> None:
        self._call("set", self.key_prefix + key, data)

    def contains(self, key: str) -> bool:
        return bool(self._call("exists", self.key_prefix + key))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One pipeline of ``EXISTS`` per key (a multi-key ``EXISTS`` only counts them)."""
        pipeline = self._client.pipeline(transaction=False)
        for key in keys:
            pipeline.exists(self.key_prefix + key)
        return [bool(found) for found in self._call("execute", client=pipeline)]

    def evict(self, key: str) -> None:
        self._call("delete", self.key_prefix + key)

    def close(self) -> None:
        self._client.close()


def check_tier_spec(spec: object) -> None:
    """Validate a tier's configuration without building it (a ValueError names the key)."""
    if not isinstance(spec, dict):
        raise ValueError(f"a tier must be a dict with a 'type', got {spec!r}")
    kind = spec.get("type")
    allowed = {"cpu": {"max_bytes"}, "disk": {"path", "max_bytes"}, "redis": {"url", "key_prefix"}}
    if kind not in allowed:
        raise ValueError(f"tier type must be one of {TIER_TYPES}, got {kind!r}")
    unknown = set(spec) - allowed[kind] - {"type"}
    if unknown:
        raise ValueError(f"{kind} tier: unknown keys {sorted(unknown)}")
    if kind in ("cpu", "disk"):
        _check_max_bytes(kind, spec.get("max_bytes"))
    if kind == "disk" and (not isinstance(spec.get("path"), str) or not spec["path"]):
        raise ValueError(f"disk tier: path must be a directory name, got {spec.get('path')!r}")
    url = spec.get("url")
    if kind == "redis" and (
        not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://"))
    ):
        raise ValueError(f"redis tier: url must be a redis:// URL, got {url!r}")


def make_tier(spec: dict) -> KVTier:
    """A tier from its configuration: ``{"type": "cpu", "max_bytes": N}``,
    ``{"type": "disk", "path": DIR, "max_bytes": N}`` or ``{"type": "redis", "url": URL}``."""
    check_tier_spec(spec)
    if spec["type"] == "cpu":
        return CPUTier(spec["max_bytes"])
    if spec["type"] == "disk":
        return DiskTier(spec["path"], spec["max_bytes"])
    return RedisTier(spec["url"], spec.get("key_prefix", "ember:kv:"))
