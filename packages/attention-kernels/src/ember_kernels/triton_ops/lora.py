"""LoRA shrink and expand in Triton: one program per row and column block, reading its row's
adapter slot (the batched gather form of Punica's BGMV), float32 sums."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    out_ptr, x_ptr, a_ptr, slots_ptr, K, R, x_stride, a_slot_stride, out_stride, scale,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # A row without an adapter reads nothing: its limits drop to zero.
    k_limit = tl.where(slot >= 0, K, 0)
    base = a_ptr + tl.maximum(slot, 0) * a_slot_stride
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_limit
        xv = tl.load(x_ptr + row * x_stride + ks, mask=kmask, other=0.0).to(tl.float32)
        amask = (rs[:, None] < R) & kmask[None, :]
        av = tl.load(base + rs[:, None] * K + ks[None, :], mask=amask, other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    result = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + rs, result, mask=rs < R)


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, slots_ptr, N, R, y_stride, h_stride, b_slot_stride, b_n_stride,
    b_r_stride, y_offset, h_offset, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    r_limit = tl.where(slot >= 0, R, 0)
    n_limit = tl.where(slot >= 0, N, 0)
    base = b_ptr + tl.maximum(slot, 0) * b_slot_stride
    hmask = rs < r_limit
    hv = tl.load(h_ptr + row * h_stride + h_offset + rs, mask=hmask, other=0.0).to(tl.float32)
    bmask = (ns[:, None] < N) & hmask[None, :]
    bv = tl.load(
        base + ns[:, None] * b_n_stride + rs[None, :] * b_r_stride, mask=bmask, other=0.0
    ).to(tl.float32)
    delta = tl.sum(bv * hv[None, :], axis=1)
    ymask = ns < n_limit
    y_row = y_ptr + row * y_stride + y_offset + ns
    yv = tl.load(y_row, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_row, (yv + delta).to(y_ptr.dtype.element_ty), mask=ymask)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """Triton ``ember_kernels.lora.lora_shrink`` (same contract, slot indices as a tensor)."""
    x, lora_a = _rows_contiguous(x), lora_a.contiguous()
    rows, k, r = x.shape[0], x.shape[1], lora_a.shape[1]
    if rows and r:
        block_r = min(triton.next_power_of_2(r), 64)
        block_k = min(triton.next_power_of_2(k), 256)
        grid = (rows, triton.cdiv(r, block_r))
        _shrink_kernel[grid](
            out, x, lora_a, slots, k, r, x.stride(0), lora_a.stride(0), out.stride(0), scale,
            BLOCK_R=block_r, BLOCK_K=block_k,
        )  # fmt: skip
    return out


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    y_offset: int,
    h_offset: int,
) -> torch.Tensor:
    """Triton ``ember_kernels.lora.lora_expand`` (same contract, slot indices as a tensor)."""
    if y.stride(1) != 1:
        raise ValueError("y: rows must be contiguous")
    h = _rows_contiguous(h)  # lora_b in any layout: the kernel reads its strides
    rows, n, r = y.shape[0], lora_b.shape[1], lora_b.shape[2]
    if rows and n and r:
        block_n = min(triton.next_power_of_2(n), 256)
        grid = (rows, triton.cdiv(n, block_n))
        _expand_kernel[grid](
            y, h, lora_b, slots, n, r, y.stride(0), h.stride(0), lora_b.stride(0),
            lora_b.stride(1), lora_b.stride(2), y_offset, h_offset, BLOCK_N=block_n,
            BLOCK_R=triton.next_power_of_2(r),
        )  # fmt: skip
    return y


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()
