"""Linear layers on weights packed once for oneDNN's CPU matmul.

``y = x W^T + b`` through torch's default CPU GEMM (MKL) is slow on some CPUs for a decoder's
shapes, and converts bfloat16 operands on each call; oneDNN, on a weight reordered once into its
blocked layout, is faster except for small float32 weights at one token
(``benchmarks/bench_packed_linear.py``; the README has the figures). vLLM's CPU backend packs its
weights for oneDNN the same way. ``pack_linear_weight`` returns an opaque oneDNN tensor that
replaces the plain weight (no second copy); ``linear`` takes either kind, and the compiled
decoder stack (``cpu_ops.decoder_stack``) calls the same oneDNN operation on packed weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_kernels import cpu_ops
from ember_kernels.cpu_features import has_bf16_arithmetic
from ember_kernels.int8_linear import int8_linear
from ember_kernels.w8a8_linear import w8a8_linear


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes packed here: float32, and bfloat16 where the CPU has bfloat16 dot
    products (AMX or AVX512-BF16, which oneDNN's bfloat16 matmul uses; without them it converts
    every operand and torch's own path serves as well)."""
    return (torch.float32, torch.bfloat16) if has_bf16_arithmetic() else (torch.float32,)


def can_pack_linear_weight(weight: torch.Tensor) -> bool:
    """Whether ``weight [out, in]`` can be packed here: a ``packable_dtypes`` tensor on the CPU,
    torch built with oneDNN (not already packed)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in packable_dtypes()
        and weight.dim() == 2
        and not weight.is_mkldnn
        and torch.backends.mkldnn.is_available()
    )


# A smaller float32 weight stays plain: oneDNN's own fixed cost per call (about 10 us) outweighs
# its faster matmul at one token below about 512 x 256 (``bench_packed_linear.py``; the README has
# the figures). In bfloat16 torch's own matmul converts its operands and oneDNN's was ahead at
# every size measured, down to 256 x 256 at one token, so every bfloat16 weight is packed.
MIN_PACKED_ELEMENTS = {torch.float32: 1 << 17, torch.bfloat16: 0}


def packing_pays(weight: torch.Tensor) -> bool:
    """Whether a caller that packs weights once at load should pack ``weight``: it can be packed
    here (``can_pack_linear_weight``) and holds at least ``MIN_PACKED_ELEMENTS`` of its dtype."""
    return can_pack_linear_weight(weight) and weight.numel() >= MIN_PACKED_ELEMENTS[weight.dtype]


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered into oneDNN's blocked layout, for ``linear``; ValueError
    where ``can_pack_linear_weight`` says no."""
    if not can_pack_linear_weight(weight):
        raise ValueError(
            f"weight: cannot pack a {weight.dtype} {tuple(weight.shape)} tensor on "
            f"{weight.device} for oneDNN ([out, in] CPU tensors of {packable_dtypes()}, torch "
            "with oneDNN)"
        )
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


BLOCK_WIDTHS = (64, 32)  # the blocked layouts Ember's kernel reads (cpu_ops/packed_gemv.cpp)


def block_linear_weight(weight: torch.Tensor, block: int) -> torch.Tensor:
    """A bfloat16 ``weight [out, in]`` as a plain tensor in the blocked layout Ember's streaming
    kernel reads, ``[out / block, in / 2, block, 2]``: blocks of ``block`` (64 or 32) output
    channels, each holding its channels' pairs of inputs one pair after another (the layouts
    oneDNN packs bfloat16 weights in for AVX512-BF16 and AMX), for ``cpu_ops.blocked_linear``.
    ValueError naming the argument where ``block`` is not one of ``BLOCK_WIDTHS`` or ``weight``
    is not such a matrix (``out`` a multiple of ``block``, ``in`` even)."""
    if block not in BLOCK_WIDTHS:
        raise ValueError(f"block: one of {BLOCK_WIDTHS}, got {block}")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.is_mkldnn:
        raise ValueError(
            f"weight: a plain bfloat16 [out, in] tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    if out_features % block or in_features % 2:
        raise ValueError(
            f"weight: [out, in] with out a multiple of {block} and in even, got "
            f"{tuple(weight.shape)}"
        )
    pairs = weight.reshape(out_features // block, block, in_features // 2, 2)
    return pairs.transpose(1, 2).contiguous()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """``x W^T + b`` for a plain weight, one from ``pack_linear_weight``, or an int8 one with its
    per-channel ``scales`` (``ember_kernels.int8_linear.quantize_int8``): weight-only, or with
    ``quantize_activations`` W8A8, ``x`` quantized to int8 per token
    (``ember_kernels.w8a8_linear``)."""
    if weight.dtype == torch.int8:
        if scales is None:
            raise ValueError("scales: an int8 weight needs its per-channel scales")
        if quantize_activations:
            return w8a8_linear(x, weight, scales, bias)
        return int8_linear(x, weight, scales, bias)
    if quantize_activations:
        raise ValueError(f"quantize_activations: needs an int8 weight, got {weight.dtype}")
    if weight.is_mkldnn:
        if cpu_ops.available():  # the compiled stack's path
            return cpu_ops.packed_linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
