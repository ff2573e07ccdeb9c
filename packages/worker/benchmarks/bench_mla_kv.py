"""KV cache bytes per token of DeepSeek's latent attention against its multi-head equivalent.

The models are built on the meta device (no weights, no memory) from their configurations, and
their KV cache spec is taken as the engine takes it (``KVCacheSpec.for_model``). The multi-head
equivalent caches, per layer, every head's key (``qk_nope_head_dim + qk_rope_head_dim``) and
value (``v_head_dim``), as a runtime without the latent cache does. Sizes only: nothing is timed.
"""

from __future__ import annotations

import pathlib

import torch

from ember_worker.hf_config import hf_config_from_dict
from ember_worker.kv_cache import KVCacheSpec
from ember_worker.model_loader import LoadedModel
from ember_worker.models import DecoderConfig, DecoderForCausalLM

BUDGET = 8 * 1024**3  # bytes of KV cache
DTYPE = torch.bfloat16
MODELS = {
    "DeepSeek-V2-Lite": dict(
        model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
        num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=27, q_lora_rank=None,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
    ),
    "DeepSeek-V2": dict(
        model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=5120,
        num_attention_heads=128, num_key_value_heads=128, num_hidden_layers=60,
        intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, n_group=8,
        topk_group=3, topk_method="group_limited_greedy",
    ),
    "DeepSeek-V3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"]),
}  # fmt: skip


def latent_spec(raw: dict) -> tuple[KVCacheSpec, DecoderConfig]:
    hf_config = hf_config_from_dict(raw)
    config = DecoderConfig.from_hf_config(hf_config)
    with torch.device("meta"):
        model = DecoderForCausalLM(config, dtype=DTYPE)
    loaded = LoadedModel(model, config, hf_config, DTYPE, pathlib.Path("."))
    return KVCacheSpec.for_model(loaded, block_size=16), config


def main() -> None:
    element = torch.empty((), dtype=DTYPE).element_size()
    print(f"bfloat16 KV cache; tokens held by {BUDGET / 1024**3:.0f} GiB")
    print(f"{'model':<18} {'MLA B/token':>12} {'MHA B/token':>12} {'ratio':>7} "
          f"{'MLA tokens':>12} {'MHA tokens':>11}")  # fmt: skip
    for name, raw in MODELS.items():
        spec, config = latent_spec(raw)
        mla = spec.bytes_per_block // spec.block_size
        m = config.mla
        per_head = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
        mha = config.num_hidden_layers * config.num_attention_heads * per_head * element
        print(f"{name:<18} {mla:>12,} {mha:>12,} {mha / mla:>6.1f}x "
              f"{BUDGET // mla:>12,} {BUDGET // mha:>11,}")  # fmt: skip


if __name__ == "__main__":
    main()
