"""The mixture-of-experts switches of a checkpoint: experts, routing, shared experts, which layers.

Read from the Hugging Face config of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3
(``MoeConfig.from_hf_config``);
``DecoderConfig.moe`` holds it, None for dense models.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ember_worker.expert_placement import check_expert_placement

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    *DEEPSEEK_ARCHITECTURES,
)


@dataclass(frozen=True)
class MoeConfig:
    """Experts and routing of the sparse layers (``sparse_layers``); the other layers are dense."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    scoring: str = "softmax"
    renormalize: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    shared_intermediate_size: int = 0  # the shared expert's, 0 for none
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert
    shared_expert_name: str = "shared_expert"  # its checkpoint name (DeepSeek: shared_experts)
    router_float32: bool = False  # DeepSeek: the router's weight and logits in float32
    # Placement, the engine's choice: whole experts per tensor-parallel rank (expert parallelism)
    # rather than a slice of every expert.
    expert_parallel: bool = False
    # Which rank holds which experts under expert parallelism
    # (``ember_worker.expert_placement``).
    expert_placement: str = "linear"
    # The expert-parallel group where it is wider than the tensor-parallel one (a
    # ``TensorParallelGroup`` over data-parallel replicas); None: the tensor-parallel ranks.
    expert_group: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, hf_config: Any, architecture: str) -> MoeConfig | None:
        """The MoE switches of ``architecture``; None for a dense one."""
        if architecture not in MOE_ARCHITECTURES:
            return None
        _refuse_sliding_window(hf_config, architecture)
        layers = hf_config.num_hidden_layers
        if architecture in DEEPSEEK_ARCHITECTURES:
            return cls._deepseek(hf_config, architecture == "DeepseekV3ForCausalLM")
        if architecture == "MixtralForCausalLM":
            return cls(
                num_experts=hf_config.num_local_experts,
                top_k=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size,
                sparse_layers=(True,) * layers,
                renormalize=True,
            )
        qwen2 = architecture == "Qwen2MoeForCausalLM"
        num_experts = hf_config.num_experts if qwen2 else hf_config.num_local_experts
        step, dense = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
        sparse = tuple(
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
        return cls(
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            sparse_layers=sparse,
            renormalize=bool(hf_config.norm_topk_prob),
            shared_intermediate_size=hf_config.shared_expert_intermediate_size if qwen2 else 0,
            shared_expert_gate=qwen2,
        )

    @classmethod
    def _deepseek(cls, hf_config: Any, v3: bool) -> MoeConfig:
        """DeepSeek-V2 (softmax; groups scored by their best expert with ``group_limited_greedy``;
        weights not renormalized, as transformers') or V3 (sigmoid plus the correction bias,
        always grouped, ``norm_topk_prob``); experts from layer ``first_k_dense_replace`` on."""
        grouped = v3 or hf_config.topk_method == "group_limited_greedy"
        if not v3 and hf_config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method: {hf_config.topk_method!r} is not supported")
        first = hf_config.first_k_dense_replace
        return cls(
            num_experts=hf_config.n_routed_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            sparse_layers=tuple(i >= first for i in range(hf_config.num_hidden_layers)),
            scoring="sigmoid" if v3 else "softmax",
            renormalize=bool(v3 and hf_config.norm_topk_prob),
            num_expert_group=hf_config.n_group if grouped else None,
            topk_group=hf_config.topk_group if grouped else None,
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
            correction_bias=v3,
            shared_intermediate_size=hf_config.moe_intermediate_size
            * (hf_config.n_shared_experts or 0),
            shared_expert_name="shared_experts",
            router_float32=True,
        )


def _refuse_sliding_window(hf_config: Any, architecture: str) -> None:
    """Sliding windows of the MoE architectures are not run: refused rather than ignored."""
    window = getattr(hf_config, "sliding_window", None)
    in_use = getattr(hf_config, "use_sliding_window", True)
    if architecture == "Qwen3MoeForCausalLM":
        in_use = True  # transformers' Qwen3-MoE applies any sliding_window set
    if window and in_use:
        raise ValueError(
            f"sliding_window: {architecture} with a sliding window ({window}) is not supported"
        )


def with_expert_parallel(
    config: Any, expert_parallel: bool, placement: str = "linear", expert_group: Any = None
) -> Any:
    """``config`` (a ``DecoderConfig``) with its experts placed by expert parallelism, by
    ``placement``, over ``expert_group`` (None: the tensor-parallel ranks); ValueError for a
    model without experts or an unknown placement."""
    check_expert_placement(placement)
    if not expert_parallel:
        return config
    if config.moe is None:
        raise ValueError(
            f"enable_expert_parallel: {config.architecture} has no mixture-of-experts layers"
        )
    moe = replace(
        config.moe, expert_parallel=True, expert_placement=placement, expert_group=expert_group
    )
    return replace(config, moe=moe)
