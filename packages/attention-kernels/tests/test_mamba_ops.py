"""Mamba-2 kernels against a token-by-token recurrence: the convolution with its carried window,
the decode state update (torch and Triton) and the chunked prefill scan, in batches of requests
of different lengths, some continuing from a state."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ember_kernels.mamba import torch_ops

HEADS, HEAD_DIM, GROUPS, STATE, CHANNELS, WIDTH = 4, 8, 2, 16, 24, 4


def recurrence(x, dt, A, B, C, D, dt_bias, state):
    """One request's tokens one at a time: y and its final state (the definition)."""
    dt = F.softplus(dt + dt_bias)
    reps = HEADS // GROUPS
    ys = []
    for t in range(x.shape[0]):
        b = B[t].repeat_interleave(reps, 0)
        c = C[t].repeat_interleave(reps, 0)
        state = (
            state * torch.exp(dt[t] * A)[:, None, None]
            + (dt[t, :, None] * x[t])[..., None] * b[:, None, :]
        )
        ys.append(torch.einsum("hpn,hn->hp", state, c) + D[:, None] * x[t])
    return torch.stack(ys), state


def conv_reference(x, weight, bias, window):
    """One request's causal convolution from its window: output and the new window."""
    full = torch.cat([window.T, x])  # [history + T, C]
    out = torch.stack([(full[t : t + WIDTH] * weight.T).sum(0) + bias for t in range(x.shape[0])])
    return F.silu(out), full[-(WIDTH - 1) :].T


def params(gen):
    A = -torch.rand(HEADS, generator=gen) * 2 - 0.1
    D = torch.randn(HEADS, generator=gen)
    dt_bias = torch.randn(HEADS, generator=gen) * 0.5
    return A, D, dt_bias


LENGTHS = [5, 1, 37, 16, 2]
CONTINUES = [False, True, True, False, True]


def batch(gen, lengths):
    total = sum(lengths)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    dt = torch.randn(total, HEADS, generator=gen)
    B = torch.randn(total, GROUPS, STATE, generator=gen)
    C = torch.randn(total, GROUPS, STATE, generator=gen)
    return qsl, x, dt, B, C


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_chunk_scan_matches_the_recurrence(chunk_size):
    gen = torch.Generator().manual_seed(0)
    A, D, dt_bias = params(gen)
    qsl, x, dt, B, C = batch(gen, LENGTHS)
    states = torch.randn(8, HEADS, HEAD_DIM, STATE, generator=gen)
    slots = torch.tensor([6, 0, 3, 2, 5])
    has_initial = torch.tensor(CONTINUES)
    before = states.clone()
    y = torch_ops.ssd_chunk_scan_varlen(
        x, dt, A, B, C, D, dt_bias, states, slots, qsl, has_initial, chunk_size
    )
    for r, (start, end) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        initial = before[slots[r]] if CONTINUES[r] else torch.zeros_like(before[0])
        want_y, want_state = recurrence(
            x[start:end], dt[start:end], A, B[start:end], C[start:end], D, dt_bias, initial
        )
        torch.testing.assert_close(y[start:end], want_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states[slots[r]], want_state, atol=1e-4, rtol=1e-4)
    assert torch.equal(states[[1, 4, 7]], before[[1, 4, 7]])  # other slots untouched


def test_conv_continues_each_requests_window():
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 1, 9, 2]
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(lengths), CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen)
    bias = torch.randn(CHANNELS, generator=gen)
    windows = torch.randn(6, CHANNELS, WIDTH - 1, generator=gen)
    slots = torch.tensor([4, 1, 0, 5])
    has_initial = torch.tensor([True, True, False, True])
    before = windows.clone()
    out = torch_ops.causal_conv1d_varlen(x, weight, bias, windows, slots, qsl, has_initial)
    for r, (start, end) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        window = before[slots[r]] if has_initial[r] else torch.zeros_like(before[0])
        want, new_window = conv_reference(x[start:end], weight, bias, window)
        torch.testing.assert_close(out[start:end], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(windows[slots[r]], new_window)
    assert torch.equal(windows[[2, 3]], before[[2, 3]])


def decode_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    A, D, dt_bias = params(gen)
    _, x, dt, B, C = batch(gen, [1] * 5)
    states = torch.randn(8, HEADS, HEAD_DIM, STATE, generator=gen)
    slots = torch.tensor([7, 2, 0, 4, 5])
    has_initial = torch.tensor([True, False, True, True, False])
    return states, (x, dt, A, B, C, D, dt_bias, slots, has_initial)


def test_state_update_is_one_step_of_the_recurrence():
    states, args = decode_inputs(2)
    x, dt, A, B, C, D, dt_bias, slots, has_initial = args
    before = states.clone()
    y = torch_ops.selective_state_update(states, *args)
    for r in range(5):
        initial = before[slots[r]] if has_initial[r] else torch.zeros_like(before[0])
        want_y, want_state = recurrence(
            x[r : r + 1], dt[r : r + 1], A, B[r : r + 1], C[r : r + 1], D, dt_bias, initial
        )
        torch.testing.assert_close(y[r], want_y[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[slots[r]], want_state, atol=1e-5, rtol=1e-5)


def test_triton_state_update_matches_torch():
    # On the CPU under TRITON_INTERPRET=1 (tests/conftest.py), compiled on a GPU.
    from ember_kernels.mamba import triton_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    states, args = decode_inputs(3)
    want_states = states.clone()
    want = torch_ops.selective_state_update(want_states, *args)
    states = states.to(device)
    got = triton_ops.selective_state_update(states, *(a.to(device) for a in args))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states.cpu(), want_states, atol=1e-5, rtol=1e-5)


def test_triton_prefill_scan_matches_the_chunked_torch_scan():
    from ember_kernels.mamba import triton_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(4)
    A, D, dt_bias = params(gen)
    lengths = [5, 1, 11, 3]
    qsl, x, dt, B, C = batch(gen, lengths)
    states = torch.randn(6, HEADS, HEAD_DIM, STATE, generator=gen)
    slots = torch.tensor([5, 0, 3, 2])
    has_initial = torch.tensor([False, True, True, False])
    want_states = states.clone()
    want = torch_ops.ssd_chunk_scan_varlen(
        x, dt, A, B, C, D, dt_bias, want_states, slots, qsl, has_initial, 4
    )
    args = (x, dt, A, B, C, D, dt_bias)
    states = states.to(device)
    got = triton_ops.varlen_scan(
        *(a.to(device) for a in args), states, slots.to(device), qsl.to(device),
        has_initial.to(device),
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states.cpu(), want_states, atol=1e-4, rtol=1e-4)


def _poison_fresh_slots(states, slots, has_initial):
    """A copy of ``states`` whose fresh requests' slots hold NaN and inf, and one with zeros."""
    fresh = slots[~has_initial]
    poisoned, zeroed = states.clone(), states.clone()
    poisoned[fresh] = float("nan")
    poisoned[fresh, ..., 0] = float("inf")
    zeroed[fresh] = 0.0
    return poisoned, zeroed


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_fresh_slot_reads_as_zeros_whatever_its_memory_holds(kernel):
    # Freed cache memory can hold anything (on a GPU it often does): a fresh request's state
    # must be zeros, not the slot's bytes times zero (NaN * 0 is NaN).
    from ember_kernels.mamba import triton_ops

    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    ops = triton_ops if kernel == "triton" else torch_ops
    scan = triton_ops.varlen_scan if kernel == "triton" else torch_ops.ssd_chunk_scan_varlen
    states, args = decode_inputs(5)
    *inputs, slots, has_initial = (a.to(device) for a in args)
    poisoned, zeroed = _poison_fresh_slots(states.to(device), slots, has_initial)
    got = ops.selective_state_update(poisoned, *inputs, slots, has_initial)
    want = ops.selective_state_update(zeroed, *inputs, slots, has_initial)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert torch.equal(poisoned[slots], zeroed[slots])

    gen = torch.Generator().manual_seed(6)
    A, D, dt_bias = params(gen)
    qsl, x, dt, B, C = (t.to(device) for t in batch(gen, [3, 4]))
    slots, has_initial = (
        torch.tensor([1, 0], device=device),
        torch.tensor([False, True], device=device),
    )
    states = torch.randn(2, HEADS, HEAD_DIM, STATE, generator=gen).to(device)
    poisoned, zeroed = _poison_fresh_slots(states, slots, has_initial)
    inputs = (x, dt, A.to(device), B, C, D.to(device), dt_bias.to(device))
    got = scan(*inputs, poisoned, slots, qsl, has_initial, 4)
    want = scan(*inputs, zeroed, slots, qsl, has_initial, 4)
    assert torch.isfinite(got).all() and torch.equal(got, want)

    if kernel == "torch":  # the convolution has one implementation, torch on every device
        windows = torch.randn(2, CHANNELS, WIDTH - 1, generator=gen)
        poisoned, zeroed = _poison_fresh_slots(windows, slots, has_initial)
        x = torch.randn(7, CHANNELS, generator=gen)
        weight, bias = torch.randn(CHANNELS, WIDTH, generator=gen), torch.randn(CHANNELS)
        got = torch_ops.causal_conv1d_varlen(x, weight, bias, poisoned, slots, qsl, has_initial)
        want = torch_ops.causal_conv1d_varlen(x, weight, bias, zeroed, slots, qsl, has_initial)
        assert torch.isfinite(got).all() and torch.equal(got, want)
