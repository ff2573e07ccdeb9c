"""``kv_transfer_config``: which KV connector an engine runs, its role and its tiers."""

from __future__ import annotations

from dataclasses import dataclass

from ember_kv_cache.tier_entry import LayoutFingerprint
from ember_kv_cache.tier_store import TieredKVStore
from ember_kv_cache.tiers import check_tier_spec, make_tier

KV_CONNECTORS = ("TieredConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """``kv_transfer_config`` as vLLM spells it: ``{"kv_connector": "TieredConnector",
    "kv_role": "kv_both", "kv_connector_extra_config": {"chunk_size": 256, "tiers": [...]}}``.

    A ``kv_producer`` saves the KV it computes, a ``kv_consumer`` loads what it finds, and
    ``kv_both`` does both. ``chunk_size`` (tokens, a multiple of the block size) is the unit of
    storage; ``tiers`` are tier configurations in lookup order (see ``make_tier``).
    """

    kv_connector: str
    kv_role: str
    chunk_size: int
    tiers: tuple[dict, ...]

    @classmethod
    def from_dict(cls, config: dict) -> KVTransferConfig:
        """Validate ``config``; a ValueError names the field that is wrong."""
        if not isinstance(config, dict):
            raise ValueError(f"kv_transfer_config must be a dict, got {type(config).__name__}")
        unknown = set(config) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}")
        connector = config.get("kv_connector")
        if connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector must be one of {KV_CONNECTORS}, got {connector!r}"
            )
        role = config.get("kv_role")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {role!r}")
        extra = config.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict")
        unknown = set(extra) - {"chunk_size", "tiers"}
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")
        chunk_size = extra.get("chunk_size", 256)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(
                f"kv_connector_extra_config.chunk_size must be a positive int, got {chunk_size!r}"
            )
        tiers = extra.get("tiers")
        if not isinstance(tiers, list) or not tiers:
            raise ValueError("kv_connector_extra_config.tiers must be a non-empty list of tiers")
        for tier in tiers:
            check_tier_spec(tier)
        return cls(connector, role, chunk_size, tuple(dict(t) for t in tiers))

    def as_dict(self) -> dict:
        """The dict ``from_dict`` reads back (to hand the config to another process)."""
        return {
            "kv_connector": self.kv_connector,
            "kv_role": self.kv_role,
            "kv_connector_extra_config": {
                "chunk_size": self.chunk_size,
                "tiers": [dict(tier) for tier in self.tiers],
            },
        }

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def make_store(self, fingerprint: LayoutFingerprint) -> TieredKVStore:
        if fingerprint.chunk_size != self.chunk_size:
            raise ValueError("the fingerprint's chunk_size differs from the config's")
        return TieredKVStore([make_tier(spec) for spec in self.tiers], fingerprint)
