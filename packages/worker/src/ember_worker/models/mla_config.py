"""The multi-head latent attention (MLA) shape of a DeepSeek-V2/V3 checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember_kernels.yarn import yarn_mscale

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# The norms inside MLA (q_a_layernorm, kv_a_layernorm) use transformers' RMSNorm default, not
# the config's rms_norm_eps.
MLA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MlaConfig:
    """Low-rank query and key/value projections, and the split of a query/key head into a part
    without position (``qk_nope_head_dim``) and a rotary part shared by all heads on the key side
    (``qk_rope_head_dim``). The KV cache holds one latent per token: ``kv_lora_rank +
    qk_rope_head_dim`` values."""

    q_lora_rank: int | None  # None: one full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3), ... rather than halves
    softmax_scale: float

    @property
    def latent_size(self) -> int:
        """Values per token and layer in the KV cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any, architecture: str) -> MlaConfig | None:
        if architecture not in MLA_ARCHITECTURES:
            return None
        qk_head_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        scale = qk_head_dim**-0.5
        rope = hf_config.rope_parameters
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
            scale = scale * mscale * mscale
        interleave = architecture == "DeepseekV2ForCausalLM" or bool(
            getattr(hf_config, "rope_interleave", True)
        )
        return cls(
            q_lora_rank=hf_config.q_lora_rank,
            kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
            rope_interleave=interleave,
            softmax_scale=scale,
        )
