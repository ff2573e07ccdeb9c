"""The settings of an attention / Mamba-2 hybrid (Bamba), read from its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember_worker.models.config import DecoderConfig, rope_settings

MAMBA_HYBRID_ARCHITECTURES = ("BambaForCausalLM",)


@dataclass(frozen=True)
class MambaHybridConfig(DecoderConfig):
    """``DecoderConfig`` (the attention layers' and the MLPs' shapes) plus the Mamba-2 mixers'.

    ``mamba_layers[i]`` is True where layer ``i`` is a Mamba-2 mixer instead of attention. A
    mixer's input projection makes, per token, the gate (``mamba_intermediate``), the conv
    input (x, B and C: ``mamba_intermediate + 2 * groups * state``) and one dt per head."""

    mamba_layers: tuple[bool, ...] = ()
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 1
    mamba_state: int = 0
    mamba_conv_width: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_channels(self) -> int:
        return self.mamba_intermediate + 2 * self.mamba_groups * self.mamba_state

    @classmethod
    def from_bamba_hf_config(cls, hf_config: Any, arch: str) -> MambaHybridConfig:
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if getattr(hf_config, "num_experts", 1) not in (None, 1):
            raise ValueError("num_experts: a Bamba with experts is not supported")
        if hf_config.mamba_n_heads % hf_config.mamba_n_groups:
            raise ValueError("mamba_n_groups must divide mamba_n_heads")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        theta, scaling, partial = rope_settings(hf_config.rope_parameters)
        n = hf_config.num_hidden_layers
        limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=n,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rotary_dim=int(head_dim * partial),
            rope_scaling=scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_proj_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=False,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_windows=(None,) * n,
            mamba_layers=tuple(kind != "full_attention" for kind in hf_config.layers_block_type),
            mamba_heads=hf_config.mamba_n_heads,
            mamba_head_dim=int(hf_config.mamba_d_head),
            mamba_groups=hf_config.mamba_n_groups,
            mamba_state=hf_config.mamba_d_state,
            mamba_conv_width=hf_config.mamba_d_conv,
            mamba_chunk_size=hf_config.mamba_chunk_size,
            mamba_conv_bias=bool(hf_config.mamba_conv_bias),
            mamba_proj_bias=bool(hf_config.mamba_proj_bias),
            mamba_dt_limit=(_as_float(limit[0]), _as_float(limit[1])),
        )


def _as_float(value: Any) -> float:
    """A config number; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)
