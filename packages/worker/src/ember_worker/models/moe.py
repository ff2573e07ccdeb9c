"""Mixture-of-experts blocks: a router, the routed experts, optional shared experts.

The experts run through ``ember_kernels.moe`` (tokens grouped by expert, one matmul per expert).
Under tensor parallelism each rank holds every expert's slice of the intermediate dimension, as
the dense MLP is split, and the block's output is all-reduced. Under expert parallelism
(``expert_parallel``) each rank holds whole experts, a contiguous, equal share of them, and the
ranks' partial sums are all-reduced the same way (every rank sees every token, so no dispatch is
needed before the experts); shared experts stay tensor-parallel.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ember_kernels import moe as moe_ops
from ember_kernels.packed_linear import can_pack_linear_weight, pack_linear_weight
from ember_worker.layers.linear import MIN_PACKED_ELEMENTS, _copy_checked
from ember_worker.layers.parallel import TensorParallelGroup, divide
from ember_worker.models.config import DecoderConfig
from ember_worker.models.mlp import DecoderMLP

_EXPERT_WEIGHT = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
# Checkpoint projection name -> (parameter, part).
_EXPERT_PARTS = {
    "gate_proj": ("w13_weight", "gate"),
    "w1": ("w13_weight", "gate"),
    "up_proj": ("w13_weight", "up"),
    "w3": ("w13_weight", "up"),
    "down_proj": ("w2_weight", "down"),
    "w2": ("w2_weight", "down"),
}


def expert_weight_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """``(parameter name, (expert, part))`` for a routed expert's checkpoint tensor
    (``...experts.3.gate_proj.weight``, or Mixtral's ``w1``/``w3``/``w2``); None for any other."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    param, part = _EXPERT_PARTS[match.group(3)]
    return f"{match.group(1)}.{param}", (int(match.group(2)), part)


class MoeRouter(nn.Module):
    """The router (HF's ``gate``): one logit per expert, replicated on every rank, in its
    weight's dtype (float32 for DeepSeek, as transformers computes it, else the model's); with
    the DeepSeek-V3 correction bias where the checkpoint has one."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        weight = torch.empty(num_experts, hidden_size, dtype=dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class FusedExperts(nn.Module):
    """The routed experts' weights, stacked: ``w13_weight [experts, 2 * inter, hidden]`` (gate rows
    then up rows) and ``w2_weight [experts, hidden, inter]``, this rank's share of them."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.rank = tp.rank
        if expert_parallel:
            self.num_local = divide(num_experts, tp.size, "number of experts")
            self.first_expert = tp.rank * self.num_local
            self.inter = intermediate_size
            self.inter_shard = 0  # whole experts: no slice of the intermediate dimension
            local = torch.full((num_experts,), -1, dtype=torch.long)
            local[self.first_expert : self.first_expert + self.num_local] = torch.arange(
                self.num_local
            )
            self.register_buffer("expert_map", local, persistent=False)
        else:
            self.num_local, self.first_expert = num_experts, 0
            self.inter = divide(intermediate_size, tp.size, "moe intermediate size")
            self.inter_shard = tp.rank
            self.expert_map = None
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local, 2 * self.inter, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local, hidden_size, self.inter, dtype=dtype), requires_grad=False
        )
        self._packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the weighted expert sum (to be all-reduced)."""
        w13, w2 = self._packed or (self.w13_weight, self.w2_weight)
        return moe_ops.fused_experts(x, w13, w2, weights, ids, expert_map=self.expert_map)

    def checkpoint_shards(self, param_name: str) -> list[tuple[int, str]]:
        """The (expert, part) checkpoint tensors that fill ``param_name`` on this rank."""
        parts = ("gate", "up") if param_name == "w13_weight" else ("down",)
        experts = range(self.first_expert, self.first_expert + self.num_local)
        return [(e, p) for e in experts for p in parts]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        expert, part = shard
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return  # another rank's expert
        size, start = self.inter, self.inter_shard * self.inter
        if part == "down":
            _copy_checked(param.data[local], loaded.narrow(1, start, size))
        else:
            offset = 0 if part == "gate" else size
            _copy_checked(param.data[local].narrow(0, offset, size), loaded.narrow(0, start, size))

    def pack_weights(self) -> None:
        """Pack each expert's weights for oneDNN's CPU matmul, as the dense layers' (where they
        can be, and at least ``MIN_PACKED_ELEMENTS``); the stacked plain weights are let go."""
        first = self.w13_weight[0]
        if not can_pack_linear_weight(first) or first.numel() < MIN_PACKED_ELEMENTS[first.dtype]:
            return
        self._packed = (
            [pack_linear_weight(w) for w in self.w13_weight],
            [pack_linear_weight(w) for w in self.w2_weight],
        )
        self.w13_weight = self.w2_weight = None


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE feed-forward block (HF's ``mlp``, Mixtral's ``block_sparse_moe``)."""

    def __init__(self, config: DecoderConfig, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe = config.moe
        expert_parallel = moe.expert_parallel
        self.tp = tp
        router_dtype = torch.float32 if moe.router_float32 else dtype
        self.gate = MoeRouter(
            config.hidden_size, moe.num_experts, moe.correction_bias, router_dtype
        )
        self.experts = FusedExperts(
            config.hidden_size, moe.intermediate_size, moe.num_experts, tp, dtype, expert_parallel
        )
        self.shared_name = moe.shared_expert_name if moe.shared_intermediate_size else None
        if self.shared_name is not None:  # under its checkpoint name
            self.add_module(
                self.shared_name, DecoderMLP(config, tp, dtype, moe.shared_intermediate_size)
            )
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype).requires_grad_(False)
            if moe.shared_expert_gate
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weights, ids = moe_ops.select_experts(
            self.gate(x),
            moe.top_k,
            scoring=moe.scoring,
            renormalize=moe.renormalize,
            num_expert_group=moe.num_expert_group,
            topk_group=moe.topk_group,
            correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=moe.routed_scaling_factor,
        )
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        if self.shared_name is None:
            return out
        shared = getattr(self, self.shared_name)(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared
