"""Mixture-of-experts ops against float64 references: routing (softmax/sigmoid, grouped top-k,
correction bias, renormalization, scaling) and the grouped experts on the torch path (plain and
oneDNN-packed weights) and the Triton kernel (interpreted on the CPU)."""

from __future__ import annotations

import pytest
import torch
from ek_inputs import TOLERANCES, TRITON, fresh_generator

from ember_kernels import moe
from ember_kernels.moe import torch_experts
from ember_kernels.moe.reference import fused_experts_reference, select_experts_reference
from ember_kernels.packed_linear import can_pack_linear_weight, pack_linear_weight

ROUTERS = {
    "mixtral": dict(scoring="softmax", renormalize=True),
    "qwen-moe-unnormalized": dict(scoring="softmax", renormalize=False),
    "deepseek-v2-groups": dict(
        scoring="softmax", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
    ),
    "deepseek-v3": dict(
        scoring="sigmoid",
        renormalize=True,
        num_expert_group=4,
        topk_group=2,
        correction_bias=True,
        routed_scaling_factor=2.5,
    ),
}


def expert_inputs(gen, tokens, hidden, inter, experts, top_k, dtype):
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("router", ROUTERS, ids=str)
def test_select_experts_matches_reference(router):
    gen, seed = fresh_generator()
    kwargs = dict(ROUTERS[router])
    num_experts, top_k = 16, 3
    if kwargs.pop("correction_bias", False):
        kwargs["correction_bias"] = torch.rand(num_experts, generator=gen) * 0.5
    logits = torch.randn(23, num_experts, generator=gen)
    weights, ids = moe.select_experts(logits, top_k, **kwargs)
    assert weights.dtype == torch.float32 and ids.shape == (23, top_k)
    chosen, expected = select_experts_reference(logits, top_k, **kwargs)
    assert [set(row.tolist()) for row in ids] == chosen, f"seed {seed}"
    got = torch.zeros(23, num_experts, dtype=torch.float64).scatter_(1, ids, weights.double())
    torch.testing.assert_close(
        got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}"
    )
    if "num_expert_group" in kwargs:  # every choice lies in the token's best topk_group groups
        groups = (ids // (num_experts // 4)).tolist()
        assert all(len(set(g)) <= kwargs["topk_group"] for g in groups)


@pytest.mark.parametrize(
    ("field", "kwargs", "message"),
    [
        ("top_k", dict(top_k=9), "top_k"),
        ("scoring", dict(top_k=2, scoring="relu"), "scoring"),
        ("groups", dict(top_k=2, num_expert_group=3, topk_group=1), "num_expert_group"),
        ("topk_group", dict(top_k=2, num_expert_group=4, topk_group=5), "topk_group"),
        ("bias", dict(top_k=2, correction_bias=torch.zeros(3)), "correction_bias"),
    ],
)
def test_select_experts_rejects_bad_arguments(field, kwargs, message):
    with pytest.raises(ValueError, match=message):
        moe.select_experts(torch.randn(4, 8), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 37])
def test_torch_experts_match_reference(dtype, tokens):
    gen, seed = fresh_generator()
    x, w13, w2, weights, ids = expert_inputs(gen, tokens, 64, 48, 8, 2, dtype)
    out = moe.fused_experts(x, w13, w2, weights, ids)
    expected = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    tol = TOLERANCES[torch.float32] if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol, msg=lambda m: f"seed {seed}: {m}")


def test_torch_experts_take_packed_per_expert_weights():
    gen, seed = fresh_generator()
    x, w13, w2, weights, ids = expert_inputs(gen, 19, 256, 256, 4, 2, torch.float32)
    if not can_pack_linear_weight(w13[0]):
        pytest.skip("torch without oneDNN")
    packed13 = [pack_linear_weight(w) for w in w13]
    packed2 = [pack_linear_weight(w) for w in w2]
    out = moe.fused_experts(x, packed13, packed2, weights, ids)
    expected = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_expert_map_drops_experts_held_elsewhere(backend):
    gen, seed = fresh_generator()
    x, w13, w2, weights, ids = expert_inputs(gen, 21, 64, 48, 8, 2, torch.float32)
    # This rank holds global experts 4..7 as local 0..3.
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3])
    run = torch_experts.fused_experts if backend == "torch" else TRITON.fused_experts
    out = run(x, w13[4:], w2[4:], weights, ids, expert_map)
    expected = fused_experts_reference(
        x.double(), w13[4:].double(), w2[4:].double(), weights, ids, expert_map
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    # The two halves of the experts add up to the whole layer.
    other = run(x, w13[:4], w2[:4], weights, ids, torch.tensor([0, 1, 2, 3, -1, -1, -1, -1]))
    whole = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    torch.testing.assert_close((out + other).double(), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    # Decode-sized, mid-sized and large runs per expert: each picks its own tile sizes.
    [(1, 64, 48, 8, 2), (45, 80, 40, 6, 3), (3, 32, 64, 16, 1), (300, 32, 48, 2, 2)],
)
def test_triton_experts_match_reference(dtype, tokens, hidden, inter, experts, top_k):
    gen, seed = fresh_generator()
    x, w13, w2, weights, ids = expert_inputs(gen, tokens, hidden, inter, experts, top_k, dtype)
    out = TRITON.fused_experts(x, w13, w2, weights, ids)
    expected = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    tol = TOLERANCES[torch.float32] if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, **tol, msg=lambda m: f"seed {seed}: {m}")


def test_fused_moe_routes_then_runs_experts():
    gen, seed = fresh_generator()
    x, w13, w2, _, _ = expert_inputs(gen, 17, 64, 32, 8, 2, torch.float32)
    logits = torch.randn(17, 8, generator=gen)
    out = moe.fused_moe(x, w13, w2, logits, 2, renormalize=True)
    weights, ids = moe.select_experts(logits, 2, renormalize=True)
    expected = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_fused_experts_rejects_bad_shapes():
    x, w13, w2 = torch.randn(4, 64), torch.randn(8, 96, 64), torch.randn(8, 64, 48)
    ids, weights = torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    with pytest.raises(ValueError, match="w2"):
        moe.fused_experts(x, w13, torch.randn(8, 64, 40), weights, ids)
    with pytest.raises(ValueError, match="w2: 7 experts, w13 has 8"):
        moe.fused_experts(x, w13, torch.randn(7, 64, 48), weights, ids)
    with pytest.raises(ValueError, match="w13"):
        moe.fused_experts(x, torch.randn(8, 96, 60), w2, weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        moe.fused_experts(x, w13, w2, torch.ones(4, 3), ids)
    with pytest.raises(ValueError, match="topk_ids"):
        moe.fused_experts(x, w13, w2, weights, ids[:3])
