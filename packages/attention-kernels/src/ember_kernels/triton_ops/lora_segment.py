"""LoRA shrink and expand in Triton for batches of many rows per adapter (prefills): the rows are
grouped by adapter slot (``ember_kernels.lora.LoRAMapping.segments``, on the device, no host
sync) and each program multiplies a tile of one slot's rows by that slot's ``A`` or ``B`` tile as
a small matrix product (``tl.dot``), the segmented form of Punica's SGMV; each adapter's weights
are read once per row tile instead of once per row as in the per-row kernels of
``triton_ops.lora`` (which stay the better choice for a few rows per adapter: decoding). Tiles
are multiplied in float32 (``input_precision="ieee"``), as the other Triton kernels here.

``order`` lists the rows grouped by slot (rows without an adapter first) and ``bounds
[slots + 2]`` where each group starts: slot ``s`` owns ``order[bounds[s + 1]:bounds[s + 2]]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program: tl.dot's minimum on NVIDIA GPUs


@triton.jit
def _segment_rows(order_ptr, m0, end, BLOCK_M: tl.constexpr):
    ms = m0 + tl.arange(0, BLOCK_M)
    in_segment = ms < end
    rows = tl.load(order_ptr + ms, mask=in_segment, other=0).to(tl.int64)
    return rows, in_segment


@triton.jit
def _shrink_kernel(
    out_ptr, x_ptr, a_ptr, order_ptr, bounds_ptr, K, R, x_stride, a_slot_stride, a_r_stride,
    out_stride, scale, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0).to(tl.int64)
    m0 = tl.load(bounds_ptr + slot + 1) + tl.program_id(1) * BLOCK_M
    end = tl.load(bounds_ptr + slot + 2)
    if m0 >= end:  # past this slot's rows (the grid is sized for one slot holding every row)
        return
    rows, in_segment = _segment_rows(order_ptr, m0, end, BLOCK_M)
    rs = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    base = a_ptr + slot * a_slot_stride
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(
            x_ptr + rows[:, None] * x_stride + ks[None, :],
            mask=in_segment[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        at = tl.load(
            base + ks[:, None] + rs[None, :] * a_r_stride,
            mask=k_ok[:, None] & (rs[None, :] < R),
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(xt, at, input_precision="ieee")
    out = out_ptr + rows[:, None] * out_stride + rs[None, :]
    mask = in_segment[:, None] & (rs[None, :] < R)
    tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, order_ptr, bounds_ptr, N, R, y_stride, h_stride, b_slot_stride,
    b_n_stride, b_r_stride, y_offset, h_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0).to(tl.int64)
    m0 = tl.load(bounds_ptr + slot + 1) + tl.program_id(1) * BLOCK_M
    end = tl.load(bounds_ptr + slot + 2)
    if m0 >= end:
        return
    rows, in_segment = _segment_rows(order_ptr, m0, end, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    r_ok, n_ok = rs < R, ns < N
    ht = tl.load(
        h_ptr + rows[:, None] * h_stride + h_offset + rs[None, :],
        mask=in_segment[:, None] & r_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    bt = tl.load(
        b_ptr + slot * b_slot_stride + rs[:, None] * b_r_stride + ns[None, :] * b_n_stride,
        mask=r_ok[:, None] & n_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.dot(ht, bt, input_precision="ieee")
    y = y_ptr + rows[:, None] * y_stride + y_offset + ns[None, :]
    mask = in_segment[:, None] & n_ok[None, :]
    yv = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, (yv + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _m_blocks(order: torch.Tensor) -> int:
    # An upper bound on any slot's row tiles without a host sync: every row in one slot.
    return max(1, triton.cdiv(order.shape[0], BLOCK_M))


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    order: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``ember_kernels.lora.lora_shrink`` by row groups (``order``/``bounds``: see the module);
    rows without an adapter get zeros."""
    x = x if x.stride(1) == 1 else x.contiguous()
    if lora_a.stride(2) != 1:
        lora_a = lora_a.contiguous()
    out.zero_()
    rows, k, r = x.shape[0], x.shape[1], lora_a.shape[1]
    if rows and r:
        block_r = max(16, min(triton.next_power_of_2(r), 64))
        block_k = max(16, min(triton.next_power_of_2(k), 128))
        grid = (lora_a.shape[0], _m_blocks(order), triton.cdiv(r, block_r))
        _shrink_kernel[grid](
            out, x, lora_a, order, bounds, k, r, x.stride(0), lora_a.stride(0), lora_a.stride(1),
            out.stride(0), scale, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
        )  # fmt: skip
    return out


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    order: torch.Tensor,
    bounds: torch.Tensor,
    y_offset: int,
    h_offset: int,
) -> torch.Tensor:
    """``ember_kernels.lora.lora_expand`` by row groups, in place; ``lora_b`` in any layout."""
    if y.stride(1) != 1:
        raise ValueError("y: rows must be contiguous")
    h = h if h.stride(1) == 1 else h.contiguous()
    rows, n, r = y.shape[0], lora_b.shape[1], lora_b.shape[2]
    if rows and n and r:
        block_n = max(16, min(triton.next_power_of_2(n), 128))
        grid = (lora_b.shape[0], _m_blocks(order), triton.cdiv(n, block_n))
        _expand_kernel[grid](
            y, h, lora_b, order, bounds, n, r, y.stride(0), h.stride(0), lora_b.stride(0),
            lora_b.stride(1), lora_b.stride(2), y_offset, h_offset, BLOCK_M=BLOCK_M,
            BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(r)),
        )  # fmt: skip
    return y
