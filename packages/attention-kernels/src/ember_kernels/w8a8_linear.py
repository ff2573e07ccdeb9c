"""W8A8 int8: int8 weights and int8 activations quantized per token at run time.

The weight ``W [out, in]`` comes as ``q_w`` in int8 with one float32 scale per output channel
(``int8_linear.quantize_int8``, or a compressed-tensors checkpoint's ``weight`` and
``weight_scale``). Each row (token) of the activations ``x`` is quantized symmetrically when the
layer runs, ``s_x = max|x[m, :]| / 127`` and ``q_x = round(x / s_x)``, so that

    x W^T + b  ~=  (q_x q_w^T)[m, n] * s_x[m] * s_w[n] + b[n]

with the integer products summed exactly in int32. On the CPU the int8 matmul is torch's
``_int_mm`` (oneDNN's u8s8 kernels: AMX-INT8 or AVX512-VNNI dot products where the CPU has them),
called from the compiled kernels (``cpu_ops.w8a8_linear``, which the compiled decoder stack calls
too) where they are built, else from torch here, with the same operations in the same order;
elsewhere the reference sums the same integers in float64, which is exact for any width a model
has (|q_x q_w| <= 127^2, so 2^53 / 127^2 terms), so both give the same int32 sums.
"""

from __future__ import annotations

import torch

from ember_kernels import cpu_ops

INT8_MAX = 127


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` for ``x [m, k]``: int8 ``q [m, k]`` and float32 ``scales [m]`` with
    ``x ~= q * scales[:, None]``, one symmetric scale per row (round half to even); an all-zero
    row gets scale 1 (its ``q`` is zero)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x32 / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def w8a8_linear(
    x: torch.Tensor,
    q_weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` for ``W = q_weight * weight_scales[:, None]`` with ``x`` quantized to int8
    per token (see the module docstring); ``x [..., in]`` in float32, bfloat16 or float16,
    ``q_weight [out, in]`` int8, ``weight_scales [out]`` float32; the result in ``x``'s dtype."""
    if q_weight.dtype != torch.int8 or weight_scales.dtype != torch.float32:
        raise ValueError(
            f"q_weight/weight_scales: expected int8 and float32, got {q_weight.dtype} and "
            f"{weight_scales.dtype}"
        )
    if q_weight.dim() != 2 or weight_scales.shape != (q_weight.shape[0],):
        raise ValueError(
            f"q_weight/weight_scales: expected [out, in] and [out], got "
            f"{tuple(q_weight.shape)} and {tuple(weight_scales.shape)}"
        )
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type != "cpu":
        return w8a8_linear_reference(x, q_weight, weight_scales, bias)
    if cpu_ops.available():
        out = cpu_ops.w8a8_linear(rows, q_weight, weight_scales, bias)
    else:
        q_x, x_scales = quantize_per_token(rows)
        # ``q_weight.t()`` of the contiguous [out, in] weight is the layout oneDNN reads without
        # repacking (a contiguous [in, out] copy was 10-70x slower).
        sums = torch._int_mm(q_x, q_weight.t())
        out = _rescale(sums, x_scales, weight_scales, bias).to(x.dtype)
    return out.view(*x.shape[:-1], q_weight.shape[0])


def w8a8_linear_reference(
    x: torch.Tensor,
    q_weight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w8a8_linear`` in plain torch on any device, the int32 sums formed in float64."""
    rows = x.reshape(-1, x.shape[-1])
    q_x, x_scales = quantize_per_token(rows)
    out = _rescale(_int_sums_reference(q_x, q_weight), x_scales, weight_scales, bias)
    return out.to(x.dtype).view(*x.shape[:-1], q_weight.shape[0])


def _int_sums_reference(q_x: torch.Tensor, q_weight: torch.Tensor) -> torch.Tensor:
    return (q_x.double() @ q_weight.double().t()).to(torch.int32)


def _rescale(
    sums: torch.Tensor,
    x_scales: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    # float32 throughout, in one order for every path, so the paths agree to the bit.
    out = sums.float() * x_scales[:, None] * weight_scales[None, :]
    if bias is not None:
        out += bias.float()
    return out
