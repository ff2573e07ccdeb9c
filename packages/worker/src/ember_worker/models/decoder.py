"""One pre-norm decoder-only transformer covering Llama, Mistral, Qwen2 and Qwen3, and with
mixture-of-experts layers (``models.moe``) and latent attention (``models.mla``) Mixtral,
Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3.

The architectures differ only in switches of ``DecoderConfig``: q/k/v bias (Qwen2), per-head
q/k RMSNorm (Qwen3), RoPE scaling (Llama 3), sliding windows (Mistral) and tied embeddings; a
layer's attention and feed-forward block are picked by ``config.mla`` and ``config.moe``.
Tokens of all sequences are concatenated into one ``[num_tokens, hidden]`` batch (no padding);
attention reads and writes the paged KV cache through ``ember_kernels``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import ember_kernels as ek
from ember_worker.distributed.groups import SINGLE_STAGE, PipelineStage
from ember_worker.layers.attention import AttentionMetadata, PagedAttention
from ember_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    pack_weight,
    quantize_weight,
)
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup
from ember_worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ember_worker.models.config import DecoderConfig
from ember_worker.models.cpu_stack import build_cpu_stack
from ember_worker.models.inference import inference
from ember_worker.models.mla import MlaAttention
from ember_worker.models.mlp import DecoderMLP
from ember_worker.models.moe import FusedExperts, SparseMoeBlock, expert_weight_target
from ember_worker.models.norm import RMSNorm, pre_norm_block


class DecoderAttention(nn.Module):
    """Self-attention: fused q/k/v projection, optional q/k norm, RoPE, paged attention, o_proj."""

    def __init__(
        self, config: DecoderConfig, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
            tp=tp,
            dtype=dtype,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=config.o_proj_bias,
            tp=tp,
            dtype=dtype,
        )
        if config.qk_norm:
            self.q_norm = self.head_norm(head_dim, config.rms_norm_eps, dtype)
            self.k_norm = self.head_norm(head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        rope_theta, rope_scaling = self.rope_base(config, layer_index)
        self.rotary_emb = ek.RotaryEmbedding(
            head_dim,
            config.rotary_dim,
            config.max_position_embeddings,
            rope_theta,
            is_neox_style=True,
            rope_scaling=rope_scaling,
            dtype=dtype,
        )
        self.attn = PagedAttention(
            self.num_heads,
            head_dim,
            self.num_kv_heads,
            sliding_window=config.sliding_windows[layer_index],
            **self.score_settings(config),
        )

    # What variants of this attention (Gemma's) choose differently.
    head_norm = RMSNorm  # the q/k norm's class

    @staticmethod
    def rope_base(config: DecoderConfig, layer_index: int) -> tuple[float, dict | None]:
        """(rope_theta, rope_scaling) of layer ``layer_index``."""
        return config.rope_theta, config.rope_scaling

    @staticmethod
    def score_settings(config: DecoderConfig) -> dict:
        """The attention scores' ``scale`` (and ``soft_cap``) for ``PagedAttention``."""
        return {"scale": config.head_dim**-0.5}

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = hidden_states.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, metadata)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried alongside so norms fuse the addition."""

    def __init__(
        self, config: DecoderConfig, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        attention = DecoderAttention if config.mla is None else MlaAttention
        self.self_attn = attention(config, layer_index, tp, dtype)
        sparse = config.moe is not None and config.moe.sparse_layers[layer_index]
        self.mlp = SparseMoeBlock(config, tp, dtype) if sparse else DecoderMLP(config, tp, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pre_norm_block(
            hidden_states,
            residual,
            self.input_layernorm,
            lambda normed: self.self_attn(positions, normed, metadata),
            self.post_attention_layernorm,
            self.mlp,
        )


class MissingLayer(nn.Module):
    """Stands in for a decoder layer that another pipeline stage holds (keeps layer indices)."""


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (HF's ``model.`` prefix).

    Under pipeline parallelism a stage builds only its own layers; the embedding lives on the
    first stage and the final norm on the last. A stage other than the first takes the previous
    stage's ``(hidden_states, residual)``; a stage other than the last returns them.

    On the CPU the layers run as one compiled call (``cpu_stack``), built at the first forward
    after the KV caches are bound, unless ``use_cpu_stack`` is False or a KV connector's per-layer
    loads and saves must run between the layers.
    """

    use_cpu_stack = True

    def __init__(
        self,
        config: DecoderConfig,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        pp: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = pp.layer_range(config.num_hidden_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype)
            if pp.is_first
            else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp, dtype)
            if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if pp.is_last else None
        self._cpu_stack = None
        self._cpu_stack_caches = None  # the first layer's caches when the stack was built
        self._cpu_stack_kernels = None  # whether the compiled kernels were there then

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if intermediate is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate
        stack = self._stack_for(metadata)
        if stack is not None:
            hidden_states, residual = stack.forward(
                hidden_states,
                residual,
                positions,
                metadata.slot_mapping,
                metadata.block_table,
                metadata.query_start_loc,
                metadata.seq_lens,
            )
        else:
            for layer in self.layers[self.start_layer : self.end_layer]:
                hidden_states, residual = layer(positions, hidden_states, residual, metadata)
        if self.norm is None:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _stack_for(self, metadata: AttentionMetadata):
        """The compiled CPU stack of this stage's layers, built (again) when the caches it was
        bound to changed; None where the per-operation path runs."""
        if (
            not self.use_cpu_stack
            or metadata.kv_connector is not None
            or metadata.group_tables is not None  # the stack reads one block table
        ):
            return None
        caches = self.layers[self.start_layer].self_attn.attn.kv_cache
        # Also when the compiled kernels became ready (built in the background) since.
        kernels = caches is not None and caches[0].is_cpu and ek.cpu_ops.available()
        if caches is not self._cpu_stack_caches or kernels != self._cpu_stack_kernels:
            layers = list(self.layers)[self.start_layer : self.end_layer]
            self._cpu_stack = build_cpu_stack(layers)
            self._cpu_stack_caches, self._cpu_stack_kernels = caches, kernels
        return self._cpu_stack


# Checkpoint names of tensors that the decoder holds merged: (suffix, merged param, shard id).
_MERGED_WEIGHTS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class DecoderForCausalLM(nn.Module):
    """The decoder plus LM head; ``forward`` returns hidden states, ``compute_logits`` logits."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        pp: PipelineStage = SINGLE_STAGE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, tp, dtype, pp)
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype)
            if pp.is_last
            else None
        )
        # A last stage without the embedding loads the tied head from the embedding's tensor.
        self.shares_embedding = config.tie_word_embeddings and pp.is_first and pp.is_last
        if self.shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight

    def pack_linear_weights(self) -> None:
        """Pack the projections' weights and the LM head's for oneDNN's CPU matmul where they can
        be (``layers.linear.pack_weight``): faster matmuls than torch's default (the
        attention-kernels README has the figures). After loading, since the plain weights are let
        go. A head tied to the embedding is packed as a copy, since the lookup needs the plain
        table: the copy costs the table's size again in memory, as vLLM's CPU backend pays too,
        and the head is the largest matmul of a step (the worker README has the figures)."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                pack_weight(module)
            elif isinstance(module, FusedExperts):
                module.pack_weights()
        if self.lm_head is not None:
            pack_weight(self.lm_head)

    def quantize_linear_weights(self, keep_float: tuple[str, ...] = ()) -> None:
        """Quantize the projections' weights and the LM head's to int8 with group-wise scales
        (``layers.linear.quantize_weight``), after loading, except the projections named in
        ``keep_float`` (e.g. ``"qkv_proj"``), which keep the model's dtype; a head tied to the
        embedding is quantized as a copy (the lookup keeps the float table). The compiled CPU
        stack calls the same int8 matmul (``cpu_stack.build_cpu_stack``)."""
        for name, module in self.named_modules():
            projection = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            if projection and name.rpartition(".")[2] not in keep_float:
                quantize_weight(module)
        if self.lm_head is not None:
            quantize_weight(self.lm_head)

    @property
    def local_layers(self) -> range:
        """Indices of the decoder layers this pipeline stage holds."""
        return range(self.model.start_layer, self.model.end_layer)

    @inference
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage's hidden states, or ``(hidden_states, residual)`` for the next stage."""
        return self.model(input_ids, positions, metadata, intermediate)

    @inference
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into this rank's shards; returns the names loaded.

        Raises ValueError naming any checkpoint tensor without a home, or any parameter that no
        checkpoint tensor filled.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # older checkpoints store RoPE frequencies; they are recomputed
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            # Mixtral names its MoE block block_sparse_moe; the other architectures name it mlp.
            name = self._stage_name(name.replace(".block_sparse_moe.", ".mlp."))
            if name is None:
                continue
            target, shard = expert_weight_target(name) or (name, None)
            for part, merged, shard_id in _MERGED_WEIGHTS if shard is None else ():
                if part in name and name.replace(part, merged) in params:
                    target, shard = name.replace(part, merged), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", None)
            tensor = tensor.to(param.dtype)
            if loader is None:
                _copy_whole(param, tensor, name)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            filled.add(target if shard is None else f"{target}[{shard}]")
        self._check_all_filled(filled)
        return filled

    def holds_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` has a home on this pipeline stage."""
        return self._stage_name(name) is not None

    def _stage_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills on this pipeline stage; None if it belongs to
        another stage."""
        if name.startswith("model.layers."):
            index = int(name.split(".", 3)[2])
            return name if index in self.local_layers else None
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            tied_head = self.config.tie_word_embeddings and self.lm_head is not None
            return name.replace("model.embed_tokens.", "lm_head.") if tied_head else None
        if name.startswith("model.norm.") and self.model.norm is None:
            return None
        if name.startswith("lm_head.") and self.lm_head is None:
            return None
        return name

    def _check_all_filled(self, filled: set[str]) -> None:
        missing = []
        for name, module in self.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                if self.shares_embedding and full.startswith("lm_head."):
                    continue
                if isinstance(module, QKVParallelLinear):
                    needed = [f"{full}[{s}]" for s in QKVParallelLinear.SHARD_IDS]
                elif hasattr(module, "checkpoint_shards"):  # experts: one per expert and part
                    needed = [f"{full}[{s}]" for s in module.checkpoint_shards(pname)]
                elif isinstance(module, MergedColumnParallelLinear):
                    needed = [f"{full}[{i}]" for i in range(len(module.shard_sizes))]
                else:
                    needed = [full]
                missing += [n for n in needed if n not in filled]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:8]} ({len(missing)} in all)")


def _copy_whole(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


class DecoderForSequenceClassification(DecoderForCausalLM):
    """The decoder plus HF's ``score`` head (hidden -> ``num_labels``, no bias) in place of the LM
    head; ``forward`` returns hidden states, which the pooler scores at the last prompt token.
    The head is replicated on every tensor-parallel rank (the final hidden states are whole)."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        pp: PipelineStage = SINGLE_STAGE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not config.num_labels:
            raise ValueError("DecoderForSequenceClassification needs config.num_labels")
        super().__init__(config, tp=tp, pp=pp, dtype=dtype)
        self.lm_head = None  # the pooler scores hidden states with ``score`` instead
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False, dtype=dtype)
        self.score.weight.requires_grad_(False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError("a sequence classification model has no LM head: it cannot generate")
