"""The decoder's layers as one compiled call on the CPU (``ember_kernels.cpu_ops.decoder_stack``).

A step of a few tokens is made of some twenty small operations per layer, and on the CPU each one
called from Python (module call, dispatch, argument checks) costs more than its own work: for a
one-token step, more than the matmuls and attention together (the worker README has the
figures). The compiled stack runs the same kernels and matmuls in the same order from C++, so
its numbers equal the per-operation path's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember_kernels import cpu_ops

if TYPE_CHECKING:
    from ember_worker.models.decoder import DecoderLayer


def build_cpu_stack(layers: list[DecoderLayer]):
    """The compiled stack of ``layers`` (bound to their KV caches), or None where the
    per-operation path must run: not CPU tensors, a dtype or a build the kernels lack, tensor
    parallelism (a row-parallel projection all-reduces between two operations), a
    mixture-of-experts or latent-attention layer (the stack runs dense MLPs and multi-head
    attention only), or no KV cache bound yet. Projections with LoRA slots (``layer.lora``)
    give the stack their slot tensors, and the stack comes wrapped in a ``LoRADecoderStack``."""
    first = layers[0].self_attn
    if any(not hasattr(layer.self_attn, "qkv_proj") for layer in layers):  # MLA layers
        return None
    weight = first.qkv_proj.weight
    if (
        weight.device.type != "cpu"
        or layers[0].input_layernorm.weight.dtype not in cpu_ops.DTYPES
        or first.o_proj.tp.size > 1
        or any(not hasattr(layer.mlp, "gate_up_proj") for layer in layers)  # MoE layers
        or any(layer.self_attn.attn.kv_cache is None for layer in layers)
        or not cpu_ops.available()
    ):
        return None
    rotary = first.rotary_emb
    stack = cpu_ops.decoder_stack(
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        layers[0].input_layernorm.eps,
        first.attn.scale,
        rotary.cos_sin_cache,
        rotary.is_neox_style,
    )
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        key_cache, value_cache = attn.attn.kv_cache
        stack.add_layer(
            layer.input_layernorm.weight,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight,
            attn.o_proj.weight,
            attn.o_proj.bias,
            layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias,
            mlp.down_proj.weight,
            mlp.down_proj.bias,
            key_cache,
            value_cache,
            attn.attn.sliding_window or 0,
        )
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        int8 = [p for p in projections if p.weight_scale is not None]  # weight-only or W8A8
        if int8:
            scales = [p.weight_scale for p in projections]  # None: left in floating point
            stack.set_weight_scales(*scales, int8[0].quantize_activations)
        for index, projection in enumerate(projections):
            if projection.lora is not None:
                stack.set_lora(index, projection.lora.a, projection.lora.b)
    lora = layers[0].self_attn.qkv_proj.lora
    return stack if lora is None else LoRADecoderStack(stack, lora.step)


class LoRADecoderStack:
    """A compiled stack whose projections hold LoRA slots: each forward passes the step's
    per-token adapter slots (``ember_worker.lora.layers.LoRAStepMapping``; none: the base
    model alone), added by the per-row kernels or, for a step of many tokens per adapter (a
    prefill), by one matmul per adapter: the choice ``LoRAMapping.runs_compiled`` makes for the
    per-operation path, so that both give the same numbers."""

    def __init__(self, stack, step) -> None:
        self.stack = stack
        self.step = step

    def forward(self, hidden_states, *args):
        mapping = self.step.mapping
        if mapping is None:
            return self.stack.forward(hidden_states, *args)
        return self.stack.forward(
            hidden_states,
            *args,
            lora_slots=mapping.slot_indices,
            lora_grouped=not mapping.runs_compiled(hidden_states),
        )
