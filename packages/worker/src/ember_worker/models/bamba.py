"""Bamba: a decoder whose layers are Mamba-2 mixers (``models.mamba_mixer``) except a few
attention layers (the plain decoder's attention, RoPE on half of each head), each followed by
the SwiGLU MLP; pre-norm with the residual carried alongside as in ``models.decoder``.

The attention layers keep paged KV (the KV cache's full-attention group); the mixers keep one
conv window and SSM state per request (its state group). One pipeline stage, one
tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ember_worker.distributed.groups import SINGLE_STAGE, PipelineStage
from ember_worker.layers.attention import AttentionMetadata
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup
from ember_worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ember_worker.models.decoder import DecoderAttention, DecoderForCausalLM
from ember_worker.models.mamba_config import MambaHybridConfig
from ember_worker.models.mamba_mixer import Mamba2Mixer, MambaStepMetadata
from ember_worker.models.mlp import DecoderMLP
from ember_worker.models.norm import RMSNorm, pre_norm_block


class BambaLayer(nn.Module):
    """A Mamba-2 mixer or attention, then the MLP, each after its RMSNorm (HF Bamba's names:
    ``mamba`` or ``self_attn``, ``feed_forward``, ``input_layernorm``, ``pre_ff_layernorm``)."""

    def __init__(
        self, config: MambaHybridConfig, index: int, tp: TensorParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.is_mamba = config.mamba_layers[index]
        if self.is_mamba:
            self.mamba = Mamba2Mixer(config, dtype)
        else:
            self.self_attn = DecoderAttention(config, index, tp, dtype)
        self.feed_forward = DecoderMLP(config, tp, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
        step: MambaStepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_mamba:
            mixer = lambda normed: self.mamba(normed, step)  # noqa: E731
        else:
            mixer = lambda normed: self.self_attn(positions, normed, metadata)  # noqa: E731
        return pre_norm_block(
            hidden_states, residual, self.input_layernorm, mixer, self.pre_ff_layernorm,
            self.feed_forward,
        )  # fmt: skip


class BambaModel(nn.Module):
    """Embedding, the layers and ``final_layernorm`` (HF's ``model.`` prefix)."""

    def __init__(
        self, config: MambaHybridConfig, tp: TensorParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp=tp, dtype=dtype
        )
        self.layers = nn.ModuleList(
            BambaLayer(config, i, tp, dtype) for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        step = MambaStepMetadata.build(metadata)  # once per step, shared by every mixer
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, metadata, step)
        hidden_states, _ = self.final_layernorm(hidden_states, residual)
        return hidden_states


class BambaForCausalLM(DecoderForCausalLM):
    """``BambaModel`` plus the LM head; loads HF Bamba checkpoints by the decoder's loader
    (q/k/v and gate/up merged, the mixers' tensors copied whole)."""

    def __init__(
        self,
        config: MambaHybridConfig,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        pp: PipelineStage = SINGLE_STAGE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if tp.size > 1:
            raise ValueError("tensor_parallel_size must be 1 for a Mamba hybrid (Bamba)")
        if not (pp.is_first and pp.is_last):
            raise ValueError("pipeline_parallel_size must be 1 for a Mamba hybrid (Bamba)")
        nn.Module.__init__(self)
        self.config = config
        self.model = BambaModel(config, tp, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype)
        self.shares_embedding = config.tie_word_embeddings
        if self.shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def _stage_name(self, name: str) -> str | None:
        return name  # one stage holds every tensor
