"""The decoder's switches, read from a Hugging Face config of a supported architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember_worker.models.mla_config import MlaConfig
from ember_worker.models.moe_config import MoeConfig

# Architecture name in config.json -> switches that are fixed for that architecture (the rest is
# read from the config itself).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
    # Built by ember_worker.models.gemma (interleaved local / global layers).
    "Gemma2ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Gemma3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
    "MixtralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2MoeForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3MoeForCausalLM": dict(qkv_bias=False, qk_norm=True),
    "DeepseekV2ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "DeepseekV3ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    # Built by ember_worker.models.bamba (Mamba-2 mixers beside a few attention layers).
    "BambaForCausalLM": dict(qkv_bias=False, qk_norm=False),
}

# A sequence classifier is the same decoder with a ``score`` head: architecture -> its decoder's.
SEQUENCE_CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the decoder needs to know about a checkpoint's shape and variant."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # head_dim * partial_rotary_factor
    rope_scaling: dict[str, Any] | None  # HF-style, None for plain RoPE
    max_position_embeddings: int
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_proj_bias: bool  # Llama with attention_bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    num_labels: int | None = None  # a sequence classifier's (its score head's outputs)
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model
    mla: MlaConfig | None = None  # DeepSeek's multi-head latent attention

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> DecoderConfig:
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        classifier = next((a for a in archs if a in SEQUENCE_CLASSIFIERS), None)
        if arch is None and classifier is not None:
            arch = SEQUENCE_CLASSIFIERS[classifier]
        if arch is None:
            raise ValueError(
                f"architecture {archs or getattr(hf_config, 'model_type', None)!r} is not "
                f"supported; Ember supports "
                f"{sorted([*SUPPORTED_ARCHITECTURES, *SEQUENCE_CLASSIFIERS])}"
            )
        if arch.startswith("Gemma") and classifier is None:
            from ember_worker.models.gemma import GemmaConfig  # it builds on this module

            return GemmaConfig.from_gemma_hf_config(hf_config, arch)
        if arch == "BambaForCausalLM":
            from ember_worker.models.mamba_config import MambaHybridConfig

            return MambaHybridConfig.from_bamba_hf_config(hf_config, arch)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        switches = SUPPORTED_ARCHITECTURES[arch]
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        theta, scaling, partial = _rope_parameters(hf_config)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rotary_dim=int(head_dim * partial),
            rope_scaling=scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            qkv_bias=(switches["qkv_bias"] and getattr(hf_config, "qkv_bias", True))
            or attention_bias,
            o_proj_bias=attention_bias and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=switches["qk_norm"],
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(hf_config),
            num_labels=hf_config.num_labels if classifier is not None else None,
            moe=MoeConfig.from_hf_config(hf_config, arch),
            mla=MlaConfig.from_hf_config(hf_config, arch),
        )


def _rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from transformers 5's standardized
    ``rope_parameters`` (as ``hf_config.load_hf_config`` builds it from the older ``rope_theta``
    and ``rope_scaling`` fields too)."""
    return rope_settings(hf_config.rope_parameters)


def rope_settings(rope_parameters: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling or None for plain RoPE, partial_rotary_factor) of one
    standardized ``rope_parameters`` dict."""
    scaling = dict(rope_parameters)
    theta = float(scaling.pop("rope_theta"))
    partial = float(scaling.pop("partial_rotary_factor", 1.0))
    if scaling["rope_type"] == "default":
        return theta, None, partial
    return theta, scaling, partial


def _sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer window: Mistral applies ``sliding_window`` to every layer; Qwen2/3 only to the
    layers ``layer_types`` marks as sliding, and only with ``use_sliding_window``."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return (None,) * n
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * n
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
