"""The routed experts' weights after packing (``FusedExperts.pack_weights``): where the compiled
kernel runs, the stacked weights stay the one copy (a few tokens run the kernel, many the
per-expert matmuls on them); elsewhere they are packed for oneDNN and let go. Every path equals
the float64 reference."""

from __future__ import annotations

import pytest
import torch

from ember_kernels import cpu_ops
from ember_kernels.moe import cpu_experts
from ember_kernels.moe.reference import fused_experts_reference
from ember_kernels.packed_linear import can_pack_linear_weight
from ember_worker.layers.parallel import SINGLE_RANK
from ember_worker.models.moe import FusedExperts

HIDDEN, INTER, EXPERTS, TOP_K = 256, 256, 4, 2


def _experts(gen: torch.Generator) -> FusedExperts:
    experts = FusedExperts(HIDDEN, INTER, EXPERTS, SINGLE_RANK, torch.float32)
    experts.w13_weight.data.copy_(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / 16)
    experts.w2_weight.data.copy_(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / 16)
    return experts


@pytest.mark.skipif(not cpu_ops.available(), reason="compiled CPU kernels unavailable")
def test_experts_keep_one_stacked_copy_where_the_kernel_runs(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    experts = _experts(gen)
    if not can_pack_linear_weight(experts.w13_weight[0]):
        pytest.skip("torch without oneDNN")
    w13, w2 = experts.w13_weight.clone(), experts.w2_weight.clone()
    experts.pack_weights()
    assert experts._packed is None and experts.w13_weight is not None
    calls = []
    compiled = cpu_ops.moe_experts
    monkeypatch.setattr(cpu_ops, "moe_experts", lambda *a: calls.append(1) or compiled(*a))
    for tokens, runs_compiled in ((2, True), (cpu_experts.COMPILED_MAX_TOKENS + 9, False)):
        calls.clear()
        x = torch.randn(tokens, HIDDEN, generator=gen)
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
        weights = torch.rand(tokens, TOP_K, generator=gen)
        out = experts(x, weights, ids)
        assert bool(calls) == runs_compiled
        expected = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_experts_without_the_compiled_kernel_let_the_stacked_weights_go(monkeypatch):
    experts = _experts(torch.Generator().manual_seed(1))
    if not can_pack_linear_weight(experts.w13_weight[0]):
        pytest.skip("torch without oneDNN")
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    experts.pack_weights()
    assert experts._packed is not None and experts.w13_weight is None and experts.w2_weight is None


def test_a_first_start_keeps_the_weights_stacked_without_waiting_for_the_build(monkeypatch):
    # The kernels still compiling in the background (an empty cache): loading must not wait for
    # the compiler, and the experts take the layout the kernel will read; the torch path runs
    # that layout until the build is done.
    experts = _experts(torch.Generator().manual_seed(2))
    if not can_pack_linear_weight(experts.w13_weight[0]):
        pytest.skip("torch without oneDNN")
    w13, w2 = experts.w13_weight.clone(), experts.w2_weight.clone()

    def waits():
        raise AssertionError("loading waited for the kernel build")

    monkeypatch.setattr(cpu_ops, "building_now", lambda: True)
    monkeypatch.setattr(cpu_ops, "available", waits)
    experts.pack_weights()
    assert experts._packed is None and torch.equal(experts.w13_weight, w13)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)  # a step while the build runs
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(3)])
    weights = torch.rand(3, TOP_K, generator=gen)
    expected = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    torch.testing.assert_close(experts(x, weights, ids).double(), expected, rtol=1e-4, atol=1e-4)
