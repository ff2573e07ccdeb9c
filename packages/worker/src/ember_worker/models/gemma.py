"""Gemma 2 and Gemma 3 (text): interleaved local (sliding window) and global attention layers.

What sets them apart from the plain decoder: embeddings scaled by ``sqrt(hidden_size)``; RMSNorm
scaling by ``1 + weight``; four norms per layer (before and after attention and after the MLP,
"sandwich" norms, each added to the residual after its post-norm); queries scaled by
``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``; a gelu(tanh) MLP; Gemma 2's
tanh soft-capping of attention scores and of the final logits; Gemma 3's per-head q/k RMSNorm and
a RoPE base of its own for the local layers. The checkpoint names are the plain decoder's, so the
loading is ``DecoderForCausalLM``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ember_worker.distributed.groups import SINGLE_STAGE, PipelineStage
from ember_worker.layers.attention import AttentionMetadata
from ember_worker.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup
from ember_worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ember_worker.models.config import DecoderConfig, rope_settings
from ember_worker.models.decoder import DecoderAttention, DecoderForCausalLM

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    """``DecoderConfig`` plus Gemma's own settings."""

    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # RoPE (theta, scaling) of the local layers; the global layers take the decoder's fields.
    local_rope_theta: float = 10_000.0
    local_rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_gemma_hf_config(cls, hf_config: Any, arch: str) -> GemmaConfig:
        act = getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        rope = hf_config.rope_parameters
        if "full_attention" in rope:  # Gemma 3: one set per layer type
            theta, scaling, partial = rope_settings(rope["full_attention"])
            local_theta, local_scaling, _ = rope_settings(rope["sliding_attention"])
        else:
            theta, scaling, partial = rope_settings(rope)
            local_theta, local_scaling = theta, scaling
        window = hf_config.sliding_window
        windows = tuple(
            int(window) if kind == "sliding_attention" and window else None
            for kind in hf_config.layer_types
        )
        num_heads = hf_config.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=hf_config.head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rotary_dim=int(hf_config.head_dim * partial),
            rope_scaling=scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            qkv_bias=bool(hf_config.attention_bias),
            o_proj_bias=bool(hf_config.attention_bias),
            mlp_bias=False,
            qk_norm=arch == "Gemma3ForCausalLM",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            sliding_windows=windows,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
            attn_logit_softcapping=hf_config.attn_logit_softcapping,
            final_logit_softcapping=hf_config.final_logit_softcapping,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
        )


class GemmaRMSNorm(nn.Module):
    """RMSNorm in float32 that scales by ``1 + weight`` (the checkpoint stores the offset)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(DecoderAttention):
    """``DecoderAttention`` with Gemma's ``(1 + w)`` q/k norm, the local RoPE base on sliding
    layers, the query scale ``query_pre_attn_scalar ** -0.5`` and the score soft-cap."""

    head_norm = GemmaRMSNorm

    @staticmethod
    def rope_base(config: GemmaConfig, layer_index: int) -> tuple[float, dict | None]:
        if config.sliding_windows[layer_index] is not None:
            return config.local_rope_theta, config.local_rope_scaling
        return config.rope_theta, config.rope_scaling

    @staticmethod
    def score_settings(config: GemmaConfig) -> dict:
        return {
            "scale": config.query_pre_attn_scalar**-0.5,
            "soft_cap": config.attn_logit_softcapping,
        }


class GemmaMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` with gate and up in one matmul."""

    def __init__(self, config: GemmaConfig, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=False, tp=tp, dtype=dtype
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, tp=tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP, each between a pre-norm and a post-norm, each added to the residual."""

    def __init__(
        self, config: GemmaConfig, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_index, tp, dtype)
        self.mlp = GemmaMLP(config, tp, dtype)
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden_states), metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mixed)


class GemmaModel(nn.Module):
    """Scaled embedding, the layers and the final norm (HF's ``model.`` prefix); one pipeline
    stage only."""

    def __init__(
        self, config: GemmaConfig, tp: TensorParallelGroup, dtype: torch.dtype, pp: PipelineStage
    ) -> None:
        super().__init__()
        if not (pp.is_first and pp.is_last):
            raise ValueError(
                f"pipeline_parallel_size must be 1 for {config.architecture} (Gemma runs on one "
                "pipeline stage)"
            )
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype
        )
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, tp, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # The scale is rounded to the activations' dtype first, as the checkpoints were trained.
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, metadata)
        return self.norm(hidden_states)


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 2 / Gemma 3 text with the LM head (tied to the embedding, as the checkpoints are),
    and the final logits soft-capped where the config says so."""

    def __init__(
        self,
        config: GemmaConfig,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        pp: PipelineStage = SINGLE_STAGE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = GemmaModel(config, tp, dtype, pp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype)
        self.shares_embedding = config.tie_word_embeddings
        if self.shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
