"""SiLU-and-mul in Triton: one program per row and column block, float32 arithmetic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * 2 * D + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * D + D + cols, mask=mask, other=0.0).to(tl.float32)
    result = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * D + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``silu(x[..., :d]) * x[..., d:]`` (same contract as ``ember_kernels.silu_and_mul``)."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif not out.is_contiguous() or out.shape != shape:
        raise ValueError(f"out: expected a contiguous tensor of shape {shape}")
    rows = x.numel() // (2 * d) if d else 0
    if rows:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](out, x, D=d, BLOCK=block)
    return out
