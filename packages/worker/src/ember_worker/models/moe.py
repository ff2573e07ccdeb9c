"""Mixture-of-experts blocks: a router, the routed experts, optional shared experts.

The experts run through ``ember_kernels.moe`` (tokens grouped by expert, one matmul per expert).
Under tensor parallelism each rank holds every expert's slice of the intermediate dimension, as
the dense MLP is split, and the block's output is all-reduced. Under expert parallelism
(``expert_parallel``) the tensor-parallel ranks form the expert-parallel group: each holds whole
experts (``ExpertPlacement``: by default ``"linear"``, a contiguous block each, or
``"round_robin"``; the shares differ by at most one expert) and the shared experts whole. The attention's output is the same
on every rank, so each rank takes its slice of the tokens (``token_slice``), routes it, sends
each token to the ranks holding its experts and gets the results back (all-to-all dispatch and
combine), adds the shared experts, and the slices are gathered onto every rank.

With data-parallel attention (``MoeConfig.expert_group``) the expert-parallel group is wider: the
ranks of every data-parallel replica, each replica with tokens of its own. Tokens are sliced over
the replica's tensor-parallel ranks as above and dispatched over the whole group. A replica with
nothing to run still takes part in every layer's all-to-all (``idle_expert_pass``): its experts
serve the other replicas' tokens.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ember_kernels import moe as moe_ops
from ember_kernels.moe import cpu_experts
from ember_kernels.packed_linear import pack_linear_weight, packing_pays
from ember_worker.layers.linear import _copy_checked
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup, divide
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
        placement: str = "linear",
    ) -> None:
        super().__init__()
        self.rank = tp.rank
        self.hidden_size, self.dtype = hidden_size, dtype  # the activations'
        self.dispatcher = None
        if expert_parallel:  # ``tp``: the expert-parallel group
            experts = moe_ops.ExpertPlacement(num_experts, tp.size, placement)
            self.local_experts = experts.local_experts(tp.rank)
            self.inter = intermediate_size
            self.inter_shard = 0  # whole experts: no slice of the intermediate dimension
            self.dispatcher = moe_ops.AllToAllDispatcher(experts, tp.rank, tp.group)
        else:
            self.local_experts = list(range(num_experts))
            self.inter = divide(intermediate_size, tp.size, "moe intermediate size")
            self.inter_shard = tp.rank
        self.num_local = len(self.local_experts)
        self._local_index = {e: i for i, e in enumerate(self.local_experts)}
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local, 2 * self.inter, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local, hidden_size, self.inter, dtype=dtype), requires_grad=False
        )
        self._packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted expert sum of the tokens ``x``: under expert parallelism the whole sum
        (this rank's tokens dispatched to every rank's experts and combined), else this rank's
        part of it (to be all-reduced)."""
        w13, w2 = self._packed or (self.w13_weight, self.w2_weight)
        if self.dispatcher is not None:
            return moe_ops.expert_parallel_experts(x, w13, w2, weights, ids, self.dispatcher)
        return moe_ops.fused_experts(x, w13, w2, weights, ids)

    def checkpoint_shards(self, param_name: str) -> list[tuple[int, str]]:
        """The (expert, part) checkpoint tensors that fill ``param_name`` on this rank."""
        parts = ("gate", "up") if param_name == "w13_weight" else ("down",)
        return [(e, p) for e in self.local_experts for p in parts]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        expert, part = shard
        local = self._local_index.get(expert)
        if local is None:
            return  # another rank's expert
        size, start = self.inter, self.inter_shard * self.inter
        if part == "down":
            _copy_checked(param.data[local], loaded.narrow(1, start, size))
        else:
            offset = 0 if part == "gate" else size
            _copy_checked(param.data[local].narrow(0, offset, size), loaded.narrow(0, start, size))

    def pack_weights(self) -> None:
        """Pack each expert's weights for oneDNN's CPU matmul, as the dense layers' (where they
        can be and it pays: ``packed_linear.packing_pays``), letting the stacked weights go; unless
        the compiled kernel (``ember_kernels.moe.cpu_experts``) runs the stacked weights: then
        they stay as they are, the one copy of the experts (an MoE model's weights are mostly
        its experts, so a second, packed copy would nearly double its memory). Decoding's few
        tokens then run the kernel and larger steps the per-expert matmuls on the stacked
        weights (slower than packed ones for prefills: ``bench_fused_moe.py``)."""
        first = self.w13_weight[0]
        if not packing_pays(first):
            return
        if cpu_experts.keeps_stacked_weights(self.w13_weight, self.w2_weight):
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
            config.hidden_size,
            moe.intermediate_size,
            moe.num_experts,
            moe.expert_group or tp,
            dtype,
            expert_parallel,
            moe.expert_placement,
        )
        self.shared_name = moe.shared_expert_name if moe.shared_intermediate_size else None
        if self.shared_name is not None:  # under its checkpoint name; whole on every EP rank
            shared_tp = SINGLE_RANK if expert_parallel else tp
            self.add_module(
                self.shared_name,
                DecoderMLP(config, shared_tp, dtype, moe.shared_intermediate_size),
            )
        # Slots routed to each expert, counted every forward (``ember_worker.expert_load``).
        self.register_buffer(
            "expert_load", torch.zeros(moe.num_experts, dtype=torch.long), persistent=False
        )
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype).requires_grad_(False)
            if moe.shared_expert_gate
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.moe.expert_parallel:
            return self._tokens_forward(x, reduce=True)
        # Expert parallel: every rank holds the same tokens; each runs its slice, then all gather.
        tp, num_tokens = self.tp, x.shape[0]
        part = self._tokens_forward(x[moe_ops.token_slice(num_tokens, tp.rank, tp.size)])
        return moe_ops.gather_token_slices(part, num_tokens, tp.size, tp.group)

    def _tokens_forward(self, x: torch.Tensor, reduce: bool = False) -> torch.Tensor:
        """Routed plus shared experts of the tokens ``x``; ``reduce``: the routed experts' output
        is this rank's part, summed over the tensor-parallel group."""
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
        self.expert_load += torch.bincount(ids.reshape(-1), minlength=moe.num_experts)
        out = self.experts(x, weights, ids)
        if reduce:
            out = self.tp.all_reduce(out)
        if self.shared_name is None:
            return out
        shared = getattr(self, self.shared_name)(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared


def idle_expert_pass(model: nn.Module) -> None:
    """A forward's share of the expert-parallel collectives for a data-parallel replica with no
    tokens: each MoE layer, in order, dispatches nothing and serves its experts to what the other
    replicas send. Touches no KV cache and no request state."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            experts, top_k = module.experts, module.moe.top_k
            device = module.gate.weight.device
            hidden = torch.empty(0, experts.hidden_size, dtype=experts.dtype, device=device)
            weights = torch.empty(0, top_k, dtype=torch.float32, device=device)
            ids = torch.empty(0, top_k, dtype=torch.long, device=device)
            experts(hidden, weights, ids)
