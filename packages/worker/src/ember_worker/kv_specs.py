"""What each layer of a model keeps in the KV cache, as ``ember_kv_cache`` specs: the scheduler's
KV cache manager groups layers by them."""

from __future__ import annotations

from ember_kv_cache import FullAttentionSpec, SlidingWindowSpec
from ember_kv_cache.specs import KVCacheSpec
from ember_worker.hf_config import load_hf_config, resolve_model_path
from ember_worker.models import DecoderConfig


def layer_kv_specs(config: DecoderConfig) -> list[KVCacheSpec]:
    """One spec per layer: a sliding window where the layer has one, else full attention."""
    return [
        FullAttentionSpec() if window is None else SlidingWindowSpec(int(window))
        for window in config.sliding_windows
    ]


def model_layer_kv_specs(model: str) -> list[KVCacheSpec]:
    """``layer_kv_specs`` of a model folder's config (for executors that load no weights)."""
    return layer_kv_specs(DecoderConfig.from_hf_config(load_hf_config(resolve_model_path(model))))
