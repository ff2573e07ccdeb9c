"""The Mamba-2 scan in Triton: one program per request, head and block of the head's channels
runs the recurrence over the request's tokens with the state rows it owns in registers (read,
decayed, fed and written back once), float32 arithmetic. A decode step is the same scan over
one token per request (same contracts as ``ember_kernels.mamba.torch_ops``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _varlen_scan_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, init_ptr,
    qsl_ptr, y_ptr, dt_min, dt_max,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, STATE: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < HEAD_DIM
    n_ok = n < STATE
    group = head // (HEADS // GROUPS)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    keep = tl.load(init_ptr + req) != 0
    rows = ((slot * HEADS + head) * HEAD_DIM + p)[:, None] * STATE + n[None, :]
    mask = p_ok[:, None] & n_ok[None, :]
    # where, not a product: a fresh slot's memory may hold NaN or inf, and NaN * 0 is NaN.
    state = tl.where(keep, tl.load(state_ptr + rows, mask=mask, other=0.0).to(tl.float32), 0.0)
    A = tl.load(A_ptr + head).to(tl.float32)
    D = tl.load(D_ptr + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1).to(tl.int64)
    for t in range(start, end):  # the recurrence, token after token, the state in registers
        dt = tl.load(dt_ptr + t * HEADS + head).to(tl.float32) + bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + (t * HEADS + head) * HEAD_DIM + p, mask=p_ok, other=0.0)
        x = x.to(tl.float32)
        bc = (t * GROUPS + group) * STATE + n
        B = tl.load(B_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
        y = tl.sum(state * C[None, :], axis=1) + D * x
        out = y_ptr + (t * HEADS + head) * HEAD_DIM + p
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=p_ok)
    tl.store(state_ptr + rows, state.to(state_ptr.dtype.element_ty), mask=mask)


def varlen_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """Triton prefill scan (same contract as ``torch_ops.ssd_chunk_scan_varlen``; ``chunk_size``
    unused): one program per request, head and block of channels runs the recurrence over the
    request's tokens with the state in registers, so a request of any length needs no padding."""
    if not ssm_states.is_contiguous():
        raise ValueError("ssm_states must be contiguous")
    num_tokens, heads, head_dim = x.shape
    num_reqs = state_indices.shape[0]
    y = torch.empty_like(x)
    if num_reqs == 0 or num_tokens == 0:
        return y
    block_p = min(triton.next_power_of_2(head_dim), 32)
    grid = (num_reqs, heads, triton.cdiv(head_dim, block_p))
    _varlen_scan_kernel[grid](
        ssm_states, x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(),
        C.contiguous(), D.contiguous(), dt_bias.contiguous(), state_indices.contiguous(),
        has_initial_state.to(torch.int32).contiguous(), query_start_loc.contiguous(), y,
        float(dt_limit[0]), min(float(dt_limit[1]), 3.0e38),
        HEADS=heads, HEAD_DIM=head_dim, STATE=ssm_states.shape[-1], GROUPS=B.shape[1],
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(ssm_states.shape[-1]),
    )  # fmt: skip
    return y


def selective_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """Triton ``selective_state_update``: ``varlen_scan`` over one token per request."""
    num_reqs = x.shape[0]
    if has_initial_state is None:
        has_initial_state = torch.ones(num_reqs, dtype=torch.bool, device=x.device)
    one_token_each = torch.arange(num_reqs + 1, dtype=torch.int32, device=x.device)
    return varlen_scan(
        x, dt, A, B, C, D, dt_bias, ssm_states, state_indices, one_token_each,
        has_initial_state, dt_limit=dt_limit,
    )  # fmt: skip
