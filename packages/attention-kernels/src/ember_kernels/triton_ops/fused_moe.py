"""The experts of a mixture-of-experts layer in Triton: two grouped matmuls over expert blocks.

The slots (token, choice) are sorted by expert and each expert's run padded to a whole number of
``BLOCK_M`` rows, so every row block belongs to one expert (``_expert_blocks``, vectorized torch,
no host sync: the block count is the upper bound ``ceil(slots / BLOCK_M) + experts``, surplus
blocks marked -1 and skipped). A program multiplies one row block by one column block of its
expert's weight: first ``hidden @ w13[e]^T`` into ``[slots, 2 * intermediate]`` (rows gathered
from the token of each slot), then SiLU-and-mul, then ``act @ w2[e]^T`` scaled by the slot's
routing weight into ``[slots, hidden]``; the ``top_k`` rows of a token are summed last.
Half-precision operands (bf16, fp16) go to the tensor cores as they are, accumulating in
float32; where either is float32 both are float32 and the dots run in IEEE float32 (not tf32:
float32 models must match their reference token for token). Tile sizes follow the rows each
expert gets: decode-sized batches are bound by reading the experts' weights (narrow row tiles,
long K steps), large ones by arithmetic (wide tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember_kernels.moe.grouping import local_expert_ids
from ember_kernels.triton_ops.activation import silu_and_mul

# (slots per expert up to, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), first match wins.
TILES_HALF = ((16, 16, 64, 128, 4, 4), (128, 64, 64, 64, 4, 4), (None, 128, 128, 64, 8, 3))
TILES_FLOAT32 = ((16, 16, 64, 64, 4, 3), (None, 64, 64, 32, 4, 3))


def _tiles(num_slots: int, num_experts: int, float32: bool) -> tuple[int, ...]:
    per_expert = num_slots / num_experts
    for limit, *tile in TILES_FLOAT32 if float32 else TILES_HALF:
        if limit is None or per_expert <= limit:
            return tuple(tile)
    raise AssertionError("the last tile has no limit")


@triton.jit
def _expert_matmul_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    weights_ptr,
    sorted_slots_ptr,
    block_experts_ptr,
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FLOAT32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    row_ok = slots < num_slots
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if FLOAT32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if MUL_WEIGHT:
        routing = tl.load(weights_ptr + slots, mask=row_ok, other=0.0)
        acc = acc * routing[:, None]
    out = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _expert_blocks(
    local_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_slots [blocks * block_m], block_experts [blocks])``: slot ids grouped by expert,
    each expert's run padded to whole blocks with ``slots`` (an out-of-range id); the expert of
    each block, -1 for surplus blocks. Slots of experts not held here are left out."""
    num_slots = local_ids.numel()
    counts = torch.bincount(local_ids, minlength=num_experts + 1)[:num_experts]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    count_start = torch.cumsum(counts, 0) - counts
    max_blocks = triton.cdiv(num_slots, block_m) + num_experts
    order = torch.argsort(local_ids, stable=True)
    sorted_ids = local_ids[order]
    held = sorted_ids < num_experts
    expert = sorted_ids.clamp(max=num_experts - 1)
    rank = torch.arange(num_slots, device=local_ids.device) - count_start[expert]
    position = block_start[expert] * block_m + rank
    sorted_slots = torch.full(
        (max_blocks * block_m,), num_slots, dtype=torch.int32, device=local_ids.device
    )
    sorted_slots[position[held]] = order[held].to(torch.int32)
    block_index = torch.arange(max_blocks, device=local_ids.device)
    block_experts = torch.searchsorted(block_end, block_index, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_slots, block_experts


def _grouped_matmul(a, w, c, weights, sorted_slots, block_experts, a_row_div, mul_weight, tiles):
    num_slots, n = c.shape
    k = w.shape[2]
    block_m, block_n, block_k, num_warps, num_stages = tiles
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](
        a,
        w,
        c,
        weights,
        sorted_slots,
        block_experts,
        num_slots,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        c.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=mul_weight,
        FLOAT32=torch.float32 in (a.dtype, w.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``fused_experts`` (same contract as ``ember_kernels.moe.fused_experts``; ``w13``
    and ``w2`` as ``[experts, out, in]`` tensors)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    num_experts = w13.shape[0]
    local = local_expert_ids(topk_ids, num_experts, expert_map)
    num_slots = local.numel()
    tiles = _tiles(num_slots, num_experts, torch.float32 in (hidden.dtype, w13.dtype, w2.dtype))
    sorted_slots, block_experts = _expert_blocks(local, num_experts, tiles[0])
    weights = topk_weights.reshape(-1).float().contiguous()
    # Slots of experts held elsewhere are never written: they must read as zero in the sum.
    alloc = torch.empty if expert_map is None else torch.zeros
    gate_up = alloc(num_slots, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_matmul(hidden, w13, gate_up, weights, sorted_slots, block_experts, top_k, False, tiles)
    act = silu_and_mul(gate_up)
    down = alloc(num_slots, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_matmul(act, w2, down, weights, sorted_slots, block_experts, 1, True, tiles)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
