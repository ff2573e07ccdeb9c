"""Linear layers shaped for tensor parallelism, as in Megatron-LM and vLLM.

Each layer owns its rank's shard of the weight and a ``weight_loader`` that cuts that shard out of
a full checkpoint tensor, so a model written with them needs no change when the group grows:
column-parallel layers split the output features, row-parallel layers split the input features
and all-reduce their output. Merged layers (q/k/v, gate/up) hold several checkpoint tensors in one
weight; their loader takes the shard id.
"""

from __future__ import annotations

import torch
from torch import nn

from ember_kernels.int8_linear import quantize_int8, weight_group_size
from ember_kernels.packed_linear import MIN_PACKED_ELEMENTS as MIN_PACKED_ELEMENTS  # re-exported
from ember_kernels.packed_linear import linear, pack_linear_weight, packing_pays
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup, divide


def _empty_parameter(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def empty_weight(output_size: int, input_size: int, dtype: torch.dtype | None) -> nn.Parameter:
    """An ``[output, input]`` weight stored input-major (its transpose is contiguous).

    ``F.linear`` then hands the CPU GEMM (MKL) a plain row-major right operand, which it reads as
    it is, instead of a transposed one that it repacks at every call: 1.1-1.3x at 64 tokens, about
    2x at 8, the same at 2,048 (``benchmarks/bench_linear_layout.py``). Loaders copy into it as
    into any ``[output, input]`` tensor.
    """
    storage = torch.empty(input_size, output_size, dtype=dtype)
    return nn.Parameter(storage.t(), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the output features split across the group (no gather).

    An int8 weight has its ``weight_scale``, per output channel or per group of inputs (a
    parameter, so that a quantized checkpoint's scales load as the weight does);
    ``quantize_activations`` makes it W8A8 (per channel).
    """

    quantize_activations = False  # int8 activations per token (ember_kernels.w8a8_linear)
    # Adds each row's LoRA adapter delta to the output (``ember_worker.lora.layers``); None: none.
    lora = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size_per_partition = divide(output_size, tp.size, "output size")
        self.weight = empty_weight(self.output_size_per_partition, input_size, dtype)
        self.bias = _empty_parameter(self.output_size_per_partition, dtype=dtype) if bias else None
        self.register_parameter("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.weight_scale, self.quantize_activations)
        return y if self.lora is None else self.lora(x, y)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, tp=tp, dtype=dtype)
        self.shard_sizes = [divide(size, tp.size, "output size") for size in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        self._load_shard(param, loaded, shard_id, self.tp.rank)

    def _load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, index: int, source_rank: int
    ) -> None:
        """Copy slice ``source_rank`` of checkpoint tensor ``index`` into its place in ``param``."""
        size = self.shard_sizes[index]
        target = param.data.narrow(0, sum(self.shard_sizes[:index]), size)
        _copy_checked(target, loaded.narrow(0, source_rank * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """The query, key and value projections in one matmul, split by attention head.

    Key/value heads are replicated when the group is larger than their number.
    """

    SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.num_heads = divide(total_num_heads, tp.size, "num_attention_heads")
        if total_num_kv_heads >= tp.size:
            self.num_kv_heads = divide(total_num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp.size, total_num_kv_heads, "tensor_parallel_size")
        self.head_size = head_size
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        super().__init__(
            hidden_size,
            [q_size * tp.size, kv_size * tp.size, kv_size * tp.size],
            bias,
            tp=tp,
            dtype=dtype,
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        index = self.SHARD_IDS.index(shard_id)
        rank = self.tp.rank if index == 0 else self.tp.rank // self.kv_replicas
        self._load_shard(param, loaded, index, rank)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features split across the group and the output summed;
    ``weight_scale`` and ``quantize_activations`` as ``ColumnParallelLinear``'s (a checkpoint's
    per-channel scales are held whole by every rank; group-wise ones, quantized after loading,
    are those of the rank's own input slice)."""

    quantize_activations = False
    # Adds each row's LoRA adapter delta to the output (``ember_worker.lora.layers``); None: none.
    lora = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size_per_partition = divide(input_size, tp.size, "input size")
        self.weight = empty_weight(output_size, self.input_size_per_partition, dtype)
        self.bias = _empty_parameter(output_size, dtype=dtype) if bias else None
        self.register_parameter("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the partial products are summed.
        partial = linear(x, self.weight, None, self.weight_scale, self.quantize_activations)
        out = self.tp.all_reduce(partial)
        if self.lora is not None:
            out = self.lora(x, out)
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is not split
            _copy_checked(param.data, loaded)
            return
        size = param.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp.rank * size, size))


def pack_weight(module: nn.Module) -> None:
    """Replace ``module.weight`` by its copy packed for oneDNN's CPU matmul where packing pays
    (``ember_kernels.packed_linear.packing_pays``: float32, and bfloat16 on CPUs with bfloat16
    dot products, of at least ``MIN_PACKED_ELEMENTS``); the plain copy is let go, so this comes
    after loading. ``linear`` takes either kind."""
    if packing_pays(module.weight):
        module.weight = nn.Parameter(pack_linear_weight(module.weight), requires_grad=False)


def quantize_weight(module: nn.Module) -> None:
    """Replace the plain floating-point ``module.weight [out, in]`` (this rank's shard, after
    loading) by its int8 quantization with a float32 scale per group of inputs of each output
    channel (``ember_kernels.int8_linear.weight_group_size``), held as ``module.weight_scale
    [out, groups]``; ``linear`` takes the pair. The float weight is let go."""
    weight = module.weight.data
    q, scales = quantize_int8(weight, weight_group_size(weight.shape[1]))
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = nn.Parameter(scales, requires_grad=False)


def make_w8a8(module: nn.Module) -> None:
    """Make ``module`` (a linear layer before loading) hold an int8 weight of the same shape and
    float32 per-output-channel ``weight_scale`` for a W8A8 checkpoint to load into, and quantize
    its activations per token when it runs (``ember_kernels.w8a8_linear``)."""
    weight = module.weight
    device = weight.device
    q = torch.empty(weight.shape, dtype=torch.int8, device=device)
    module.weight = nn.Parameter(q, requires_grad=False)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=device)
    module.weight_scale = nn.Parameter(scales, requires_grad=False)
    module.quantize_activations = True


def _copy_checked(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(source.shape)} does not fit a parameter shard "
            f"of shape {tuple(target.shape)}"
        )
    target.copy_(source)
