"""Weight-only int8: per-output-channel symmetric quantization and the matmul on its weights.

A weight ``W [out, in]`` is stored as ``q = round(W / s)`` in int8 with one float32 scale per
output channel, ``s = max|W[n, :]| / 127`` (no zero point), and ``x W^T`` is computed as
``(x q^T) * s`` with float32 sums and activations kept in their own dtype. Decoding a few tokens
reads every weight once per step, so its speed is the weight bytes over memory bandwidth: int8
halves a bfloat16 weight's bytes. The compiled kernel (``cpu_ops.int8_linear``, which the
compiled decoder stack calls too) widens each weight row in registers for a step of a few rows;
larger steps are bound by arithmetic, not bytes, and it runs them as the float32 matmul on the
weight dequantized a block of output channels at a time. Without the compiled kernels (or off
the CPU) the latter runs in torch here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_kernels import cpu_ops

INT8_MAX = 127
# Output channels dequantized at a time on the torch path (a block of a 4,864-wide weight in
# float32 is about 40 MB), as the compiled kernel's large steps.
DEQUANTIZE_BLOCK = 2048


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` for ``weight [out, in]``: contiguous int8 ``q [out, in]`` and float32
    ``scales [out]`` with ``weight ~= q * scales[:, None]``; an all-zero row gets scale 1."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight: expected a floating-point [out, in] tensor, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scales[:, None]`` in ``dtype`` (the weight ``int8_linear`` multiplies by)."""
    return (q.float() * scales[:, None]).to(dtype)


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` for ``W = q * scales[:, None]`` (``quantize_int8``); ``x [..., in]`` in
    float32, bfloat16 or float16, the result in ``x``'s dtype."""
    if q.dtype != torch.int8 or scales.dtype != torch.float32:
        raise ValueError(f"q/scales: expected int8 and float32, got {q.dtype} and {scales.dtype}")
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
