"""The test-model factory: tiny random-weight models of every architecture Ember supports.

Each is a real Hugging Face folder written by the server's demo-model writer
(``ember_server.cli.demo_model.random_model_path``: same tokenizer, same cache, same on-disk form),
with the small sizes and the switches of its architecture.
"""

from __future__ import annotations

import pathlib
from typing import Any

from ember_server.cli.demo_model import (
    LLAMA_CONFIG,
    _write_atomically,
    random_model_path,
    tokenizer_path,
)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# With tied embeddings and small weights the residual stream stays close to the input token's
# embedding, so greedy decoding repeats one or two tokens; larger weights let the layers decide.
_TIED = dict(tie_word_embeddings=True, initializer_range=0.2)
_DEEPSEEK = dict(
    tie_word_embeddings=False, initializer_range=0.2, num_hidden_layers=3, num_key_value_heads=4,
    kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1,
    routed_scaling_factor=2.5,
)  # fmt: skip
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": LLAMA_CONFIG,
    "mistral": dict(tie_word_embeddings=False, sliding_window=None, head_dim=16),
    "qwen2": dict(_TIED, use_sliding_window=False),  # qkv bias is built in
    "qwen3": dict(_TIED, head_dim=32),  # q/k norm is built in
    # Interleaved local / global layers (window 16: one block of 16); Gemma 2 soft-caps scores
    # and logits, Gemma 3 has q/k norm and a local RoPE base of its own.
    "gemma2": dict(
        tie_word_embeddings=False, initializer_range=0.2, head_dim=16, sliding_window=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0, final_logit_softcapping=4.0, num_hidden_layers=4,
    ),
    "gemma3_text": dict(
        tie_word_embeddings=False, initializer_range=0.2, head_dim=16, sliding_window=16,
        query_pre_attn_scalar=24, num_hidden_layers=4,
        sliding_window_pattern=2, rope_local_base_freq=500.0,
    ),
    # Mixture-of-experts: 4 experts, 2 per token, small experts; Qwen2-MoE with a shared expert
    # and a dense layer (mlp_only_layers), Qwen3-MoE with renormalized weights (norm_topk_prob).
    # Weights large enough that greedy continuations hold many distinct tokens.
    "mixtral": dict(
        tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48, head_dim=16, initializer_range=0.2,
    ),
    "qwen2_moe": dict(
        use_sliding_window=False, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96,
        mlp_only_layers=[1], norm_topk_prob=False, initializer_range=0.2,
    ),
    "qwen3_moe": dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, initializer_range=0.25,
    ),
    # DeepSeek: multi-head latent attention (latent 48 + rotary 16 per token), a dense first layer
    # (first_k_dense_replace), 8 experts in 4 groups (2 groups per token), a shared expert. V2
    # without q_lora_rank, group-limited softmax routing and YaRN rope scaling with its softmax
    # mscale; V3 with q_lora_rank, sigmoid routing and renormalized weights.
    "deepseek_v2": dict(
        _DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
        rope_scaling=dict(
            type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=32,
            beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
        ),
    ),
    "deepseek_v3": dict(_DEEPSEEK, q_lora_rank=32, norm_topk_prob=True),  # + a correction bias
    # An attention / Mamba-2 hybrid: layer 1 attention (RoPE on half of each head), layers 0, 2
    # and 3 Mamba-2 mixers of 8 heads of 16 channels, 2 groups of B and C, a state of 16, a
    # conv of width 4 and chunks of 16 tokens (most prompts span several).
    "bamba": dict(
        tie_word_embeddings=False, initializer_range=0.2, num_hidden_layers=4,
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
        mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=2,
    ),
}  # fmt: skip
# Models whose layers keep different things in the KV cache (sliding and global layers).
HYBRID_ARCHITECTURES = ("gemma2", "gemma3_text")
# Attention / Mamba hybrids: a state per request beside paged KV.
MAMBA_HYBRID_ARCHITECTURES = ("bamba",)
# The mixture-of-experts architectures among ARCH_CONFIGS (not in ARCHITECTURES, whose fixture
# runs every dense-model test once per architecture).
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")

# The benchmarks' Llama of about 30M parameters (with ``tiny_model_path("llama", ...)``): 9 layers of
# hidden 512, 8 query / 4 KV heads of 64, MLP 1536; large enough that a step's compute, not the
# engine's host work, dominates, as in a real model.
BENCH_LLAMA_CONFIG: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=9,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)

# A Qwen2.5-0.5B-shaped model (with ``tiny_model_path("qwen2", ...)``, random weights): the size
# CPU users run, for the benchmarks that compare speed at a real shape.
QWEN_05B_CONFIG: dict[str, Any] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    initializer_range=0.02,
)

# The Qwen2.5-1.5B shape, likewise: the next size up, to check a lead holds as weights grow.
QWEN_15B_CONFIG: dict[str, Any] = dict(
    QWEN_05B_CONFIG,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    rope_theta=1e6,  # as the checkpoint's: it changes no cost, only positions' angles
)

# transformers' *ForSequenceClassification exists for these (Mistral's classifier is not one Ember
# loads); the pad token id (set in every config here) lets HF find each row's last token.
CLASSIFIER_ARCHITECTURES = ("llama", "qwen2", "qwen3")

__all__ = [
    "ARCHITECTURES",
    "BENCH_LLAMA_CONFIG",
    "CLASSIFIER_ARCHITECTURES",
    "HYBRID_ARCHITECTURES",
    "MAMBA_HYBRID_ARCHITECTURES",
    "MOE_ARCHITECTURES",
    "QWEN_05B_CONFIG",
    "QWEN_15B_CONFIG",
    "tiny_classifier_path",
    "tiny_model_path",
    "tiny_w8a8_model_path",
    "tokenizer_path",
]


def tiny_model_path(
    arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> pathlib.Path:
    """Path of a cached tiny float32 model of ``arch``, written on first use.

    ``overrides`` change config fields (sizes, rope scaling, sliding window, ...);
    ``max_shard_size`` (e.g. ``"200KB"``) splits the weights into several safetensors files.
    """
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"arch must be one of {tuple(ARCH_CONFIGS)}, got {arch!r}")
    path = random_model_path(arch, seed, max_shard_size, **{**ARCH_CONFIGS[arch], **overrides})
    if arch == "deepseek_v3":
        return _with_correction_bias(path, seed)
    return path


def _with_correction_bias(path: pathlib.Path, seed: int) -> pathlib.Path:
    """A copy of a DeepSeek-V3 folder whose routers' ``e_score_correction_bias`` (zero as
    transformers initializes it) is random, so that it changes which experts tokens choose."""

    def write(out: pathlib.Path) -> None:
        import shutil

        import torch
        from safetensors.torch import load_file, save_file

        gen = torch.Generator().manual_seed(seed)
        for item in path.iterdir():
            if item.suffix != ".safetensors":
                shutil.copy2(item, out / item.name)
                continue
            tensors = load_file(item)
            for name, tensor in tensors.items():
                if name.endswith("e_score_correction_bias"):
                    tensors[name] = (torch.rand(tensor.shape, generator=gen) - 0.5) * 0.4
            save_file(tensors, out / item.name, metadata={"format": "pt"})

    return _write_atomically(path.parent / f"{path.name}-bias", write)


def tiny_classifier_path(
    arch: str, num_labels: int = 3, seed: int = 0, **overrides: Any
) -> pathlib.Path:
    """Path of a cached tiny float32 ``*ForSequenceClassification`` model of ``arch`` (the same
    decoder as ``tiny_model_path``'s, with a ``score`` head of ``num_labels``)."""
    if arch not in CLASSIFIER_ARCHITECTURES:
        raise ValueError(f"arch must be one of {CLASSIFIER_ARCHITECTURES}, got {arch!r}")
    config = {**ARCH_CONFIGS[arch], "num_labels": num_labels, **overrides}
    return random_model_path(arch, seed, None, sequence_classification=True, **config)


# The linear layers a W8A8 checkpoint quantizes (every one inside the decoder layers).
W8A8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# config.json's quantization_config as llm-compressor writes it for W8A8 int8 (dynamic per-token
# activations, per-channel weights, the LM head left in float).
W8A8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "output_activations": None,
            "weights": dict(
                type="int", num_bits=8, symmetric=True, strategy="channel", dynamic=False,
                group_size=None, observer="minmax", actorder=None, block_structure=None,
            ),
            "input_activations": dict(
                type="int", num_bits=8, symmetric=True, strategy="token", dynamic=True,
                group_size=None, observer=None, actorder=None, block_structure=None,
            ),
        }
    },
}  # fmt: skip


def tiny_w8a8_model_path(arch: str, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Path of a cached W8A8 int8 compressed-tensors checkpoint made from ``tiny_model_path(arch,
    seed, **overrides)``: each projection's weight quantized symmetrically per output channel to
    an int8 ``weight`` and a float32 ``weight_scale [out, 1]``, the rest as it was."""
    source = tiny_model_path(arch, seed, **overrides)
    return _write_atomically(
        source.parent / f"{source.name}-w8a8-v1", lambda out: _write_w8a8(source, out)
    )


def _write_w8a8(source: pathlib.Path, out: pathlib.Path) -> None:
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.endswith(".weight") and name.split(".")[-2] in W8A8_PROJECTIONS:
                amax = tensor.float().abs().amax(dim=1, keepdim=True)
                scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
                q = torch.round(tensor.float() / scale).clamp(-127, 127).to(torch.int8)
                tensors[name] = q.contiguous()
                tensors[name.removesuffix("weight") + "weight_scale"] = scale.contiguous()
            else:
                tensors[name] = tensor.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy2(item, out / item.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = W8A8_QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2))
