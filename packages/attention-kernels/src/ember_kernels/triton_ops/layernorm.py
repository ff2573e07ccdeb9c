"""RMSNorm and fused residual-add RMSNorm in Triton: one program per row, float32 statistics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * HIDDEN + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * HIDDEN + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the storage dtype first, as an unfused add would.
        total = (x + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * HIDDEN + cols, total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * HIDDEN + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


def _launch(x, residual, weight, eps, out, residual_out):
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            out,
            residual_out,
            x,
            residual,
            weight,
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            ADD_RESIDUAL=residual is not None,
            num_warps=8 if block >= 2048 else 4,
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton RMSNorm over the last dim (same contract as ``ember_kernels.rms_norm``)."""
    x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)
    elif not out.is_contiguous() or out.shape != x.shape:
        raise ValueError(f"out: expected a contiguous tensor of shape {tuple(x.shape)}")
    _launch(x, None, weight.contiguous(), eps, out, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``(rms_norm(x + residual), x + residual)`` in one pass."""
    x = x.contiguous()
    residual = residual.contiguous()
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    _launch(x, residual, weight.contiguous(), eps, out, residual_out)
    return out, residual_out
