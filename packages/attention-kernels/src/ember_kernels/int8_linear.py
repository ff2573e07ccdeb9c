"""Weight-only int8: group-wise (or per-output-channel) symmetric quantization and the matmul on
its weights.

A weight ``W [out, in]`` is stored as ``q = round(W / s)`` in int8 with float32 scales ``s [out,
groups]``, one per ``group_size`` consecutive inputs of each output channel, ``s = max|W[n,
group]| / 127`` (no zero point): the layout of GPTQ/AWQ-style group scales without their zero
points, as torchao's int8 weight-only groups. A finer scale follows each group's own range instead
of the row's largest weight, so most weights keep more of the 8 bits. One scale per output
channel (``scales [out]``, ``group_size=None``) is the same with a single group per row; W8A8
(``ember_kernels.w8a8_linear``) takes that layout. ``x W^T`` is computed with float32 sums, each
group's partial sum times its scale, and activations kept in their own dtype.

Decoding a few tokens reads every weight once per step, so its speed is the weight bytes over
memory bandwidth: int8 halves a bfloat16 weight's bytes (a float32 scale per 128 weights adds
3%). The compiled kernel (``cpu_ops.int8_linear``, which the compiled decoder stack calls too)
reads each weight row once for a step of a few rows: for bfloat16/float16 activations in int16 x
int8 dot products (the activations quantized to int16 per weight group, 15 bits of the group's
largest magnitude, finer than their own rounding), for float32 widened to float in registers; larger steps are bound by
arithmetic, not bytes, and it runs them as the matmul of the activation dtype on the weight
dequantized a block of output channels at a time. Without the compiled kernels (or off the CPU)
the latter runs in torch here, in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_kernels import cpu_ops

INT8_MAX = 127
# Group sizes tried in order by ``weight_group_size``: 128 as the quantization libraries default
# to, 64 where an input dim is not a multiple of 128.
GROUP_SIZES = (128, 64)
# Output channels dequantized at a time on the torch path (a block of a 4,864-wide weight in
# float32 is about 40 MB), as the compiled kernel's large steps.
DEQUANTIZE_BLOCK = 2048


def weight_group_size(in_features: int) -> int:
    """The group size a weight of ``in_features`` inputs is quantized with: the first of
    ``GROUP_SIZES`` that divides it, else ``in_features`` (one scale per output channel)."""
    return next((size for size in GROUP_SIZES if in_features % size == 0), in_features)


def quantize_int8(
    weight: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` for ``weight [out, in]``: contiguous int8 ``q [out, in]`` and float32
    ``scales``, ``[out]`` for ``group_size`` None (one per output channel) or ``[out, in //
    group_size]``, with ``weight ~= q * scales`` broadcast over each group; an all-zero group gets
    scale 1. ``group_size`` must divide ``in``."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight: expected a floating-point [out, in] tensor, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    if group_size is not None and (group_size <= 0 or in_features % group_size != 0):
        raise ValueError(
            f"group_size: must be positive and divide the weight's {in_features} input "
            f"features, got {group_size}"
        )
    groups = 1 if group_size is None else in_features // group_size
    w = weight.float().reshape(out_features, groups, -1)
    amax = w.abs().amax(dim=2, keepdim=True)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    scales = scales.view(out_features) if group_size is None else scales.view(out_features, groups)
    return q.reshape(out_features, in_features).contiguous(), scales.contiguous()


def check_scales(q: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError naming ``q/scales`` unless ``q`` is an int8 ``[out, in]`` weight and ``scales``
    float32 ``[out]`` or ``[out, groups]`` with ``groups`` dividing ``in``."""
    if q.dtype != torch.int8 or scales.dtype != torch.float32:
        raise ValueError(f"q/scales: expected int8 and float32, got {q.dtype} and {scales.dtype}")
    grouped = scales.dim() == 2 and scales.shape[1] > 0 and q.shape[-1] % scales.shape[1] == 0
    if q.dim() != 2 or scales.shape[0] != q.shape[0] or not (scales.dim() == 1 or grouped):
        raise ValueError(
            f"q/scales: expected [out, in] and [out] or [out, groups] with groups dividing in, "
            f"got {tuple(q.shape)} and {tuple(scales.shape)}"
        )


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` times its scales, each over its group (``quantize_int8``), in ``dtype``: the weight
    ``int8_linear`` multiplies by."""
    groups = 1 if scales.dim() == 1 else scales.shape[1]
    w = q.float().reshape(q.shape[0], groups, -1) * scales.reshape(q.shape[0], groups, 1)
    return w.reshape(q.shape).to(dtype)


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` for ``W = dequantize_int8(q, scales)`` (``quantize_int8``); ``x [..., in]``
    in float32, bfloat16 or float16, the result in ``x``'s dtype."""
    check_scales(q, scales)
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and x.dtype in cpu_ops.DTYPES and cpu_ops.available():
        out = cpu_ops.int8_linear(rows, q, scales, bias)
    else:
        out = _dequantized_linear(rows, q, scales, bias)
    return out.view(*x.shape[:-1], q.shape[0])


def _dequantized_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # In float32 and rounded once, as the compiled kernel up to MAX_WIDENED_ROWS rows.
    x32 = x.float()
    out = x.new_empty(x.shape[0], q.shape[0])
    for start in range(0, q.shape[0], DEQUANTIZE_BLOCK):
        end = min(start + DEQUANTIZE_BLOCK, q.shape[0])
        block = F.linear(x32, dequantize_int8(q[start:end], scales[start:end], torch.float32))
        if bias is not None:
            block += bias[start:end]
        out[:, start:end] = block
    return out
