"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token's keys and values are compressed into one latent: ``kv_a_proj_with_mqa`` gives
``kv_lora_rank`` values (normed) plus a ``qk_rope_head_dim`` rotary key shared by all heads, and
the cache stores those ``kv_lora_rank + qk_rope_head_dim`` values as one KV head. Attention
absorbs the up-projection ``kv_b_proj`` (as DeepSeek and vLLM do for decode): a head's
position-free query part is mapped into the latent space by its key up-projection ``W_UK``
(``q_nope W_UK`` scores the latent as ``q_nope`` scores ``W_UK^T latent``), the heads attend over
the latents as multi-query attention (value = the latent's first ``kv_lora_rank`` values), and
each head's output is mapped back by its value up-projection ``W_UV``. The same path serves
prefill, chunked prefill and decode, so the cache never holds per-head keys or values.

Tensor parallelism splits the heads (``q_b_proj``/``q_proj``, ``kv_b_proj``, ``o_proj``); the
down-projections and the latent cache are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

import ember_kernels as ek
from ember_worker.layers.attention import AttentionMetadata, PagedAttention
from ember_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, _copy_checked
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup, divide
from ember_worker.models.config import DecoderConfig
from ember_worker.models.mla_config import MLA_NORM_EPS
from ember_worker.models.norm import RMSNorm


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: per head, the key (``W_UK``) and value (``W_UV``) up-projections of the
    latent, split by head over the ranks. Never run as a linear layer (attention absorbs it), so
    its weight stays plain: ``absorbed()`` views it per head."""

    def __init__(
        self, latent: int, head_out: int, num_heads: int, tp: TensorParallelGroup, dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        rows = divide(num_heads, tp.size, "num_attention_heads") * head_out
        self.weight = nn.Parameter(torch.empty(rows, latent, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp.rank * rows, rows))


class MlaAttention(nn.Module):
    """DeepSeek's attention layer (HF's ``self_attn``), absorbed over a latent KV cache."""

    latent_cache = True  # one cache tensor per layer, read as both keys and values

    def __init__(
        self, config: DecoderConfig, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        mla = config.mla
        self.mla = mla
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(heads, tp.size, "num_attention_heads")
        self.num_kv_heads = 1
        qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = config.qkv_bias
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head, tp=tp, dtype=dtype)
        else:
            self.q_a_proj = ColumnParallelLinear(
                hidden, mla.q_lora_rank, bias, tp=SINGLE_RANK, dtype=dtype
            )
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, MLA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(
                mla.q_lora_rank, heads * qk_head, tp=tp, dtype=dtype
            )
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, mla.latent_size, bias, tp=SINGLE_RANK, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, MLA_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(
            mla.kv_lora_rank, mla.qk_nope_head_dim + mla.v_head_dim, heads, tp, dtype
        )
        self.o_proj = RowParallelLinear(
            heads * mla.v_head_dim, hidden, bias=config.o_proj_bias, tp=tp, dtype=dtype
        )
        self.rotary_emb = ek.RotaryEmbedding(
            mla.qk_rope_head_dim,
            mla.qk_rope_head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            is_neox_style=not mla.rope_interleave,
            rope_scaling=config.rope_scaling,
            dtype=dtype,
        )
        self.attn = PagedAttention(self.num_heads, mla.latent_size, 1, scale=mla.softmax_scale)
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [heads, qk_nope, latent], W_UV^T [heads, latent, v])`` of this rank's heads,
        taken from ``kv_b_proj`` once, after loading."""
        if self._absorbed is None:
            mla = self.mla
            w = self.kv_b_proj.weight.reshape(self.num_heads, -1, mla.kv_lora_rank)
            w_uk = w[:, : mla.qk_nope_head_dim].contiguous()
            w_uv_t = w[:, mla.qk_nope_head_dim :].transpose(1, 2).contiguous()
            self._absorbed = (w_uk, w_uv_t)
        return self._absorbed

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        mla = self.mla
        num_tokens = hidden_states.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, -1)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary_emb(
            positions, q_rope.contiguous(), k_rope.reshape(num_tokens, 1, -1)
        )
        w_uk, w_uv_t = self.absorbed()
        # [heads, tokens, nope] @ [heads, nope, latent] -> the queries in the latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_rope], dim=-1)
        cached = torch.cat([latent, k_rope.view(num_tokens, -1)], dim=-1)
        out = self.attn(query.reshape(num_tokens, -1), cached, cached, metadata)
        out = out.view(num_tokens, self.num_heads, mla.latent_size)[..., : mla.kv_lora_rank]
        # [heads, tokens, latent] @ [heads, latent, v] -> each head's values.
        values = torch.bmm(out.transpose(0, 1), w_uv_t).transpose(0, 1)
        return self.o_proj(values.reshape(num_tokens, -1))
