"""The compiled CPU experts kernel (``ember_kernels.moe.cpu_experts``) against the float64 reference
and the torch path, and the dispatch between them."""

from __future__ import annotations

import pytest
import torch
from ek_inputs import TOLERANCES, fresh_generator
from test_fused_moe import expert_inputs

from ember_kernels import cpu_ops, moe
from ember_kernels.moe import cpu_experts, torch_experts
from ember_kernels.moe.reference import fused_experts_reference

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="compiled CPU kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    # widths a multiple of 64, and odd ones (vector tails)
    [(1, 128, 64, 8, 2), (5, 96, 80, 6, 3), (16, 72, 40, 4, 4), (3, 37, 19, 16, 1)],
)
def test_compiled_experts_match_reference(dtype, tokens, hidden, inter, experts, top_k):
    gen, seed = fresh_generator()
    x, w13, w2, weights, ids = expert_inputs(gen, tokens, hidden, inter, experts, top_k, dtype)
    out = cpu_experts.fused_experts(x, w13, w2, weights, ids)
    expected = fused_experts_reference(x.double(), w13.double(), w2.double(), weights, ids)
    tol = TOLERANCES[torch.float32] if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, **tol, msg=lambda m: f"seed {seed}: {m}")
    if dtype == torch.float32:  # the torch path agrees to float32 rounding
        torch_out = torch_experts.fused_experts(x, w13, w2, weights, ids)
        torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_compiled_experts_drop_experts_held_elsewhere():
    gen, seed = fresh_generator()
    x, w13, w2, weights, ids = expert_inputs(gen, 7, 64, 48, 8, 2, torch.float32)
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3])
    out = cpu_experts.fused_experts(x, w13[4:], w2[4:], weights, ids, expert_map)
    expected = fused_experts_reference(
        x.double(), w13[4:].double(), w2[4:].double(), weights, ids, expert_map
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    # A rank holding none of the chosen experts adds nothing.
    none = torch.full((8,), -1)
    assert not cpu_experts.fused_experts(x, w13[:1], w2[:1], weights, ids, none).any()


def test_few_stacked_cpu_tokens_run_compiled_many_run_torch():
    gen, _ = fresh_generator()
    few = expert_inputs(gen, cpu_experts.COMPILED_MAX_TOKENS, 64, 48, 8, 2, torch.float32)
    many = expert_inputs(gen, cpu_experts.COMPILED_MAX_TOKENS + 1, 64, 48, 8, 2, torch.float32)
    assert cpu_experts.runs_compiled(*few[:3])
    assert not cpu_experts.runs_compiled(*many[:3])
    assert not cpu_experts.runs_compiled(few[0], list(few[1]), list(few[2]))  # per-expert weights
    assert not cpu_experts.runs_compiled(few[0][:0], few[1], few[2])  # no tokens
    # moe.fused_experts takes the compiled path for the few: same values as the kernel's.
    torch.testing.assert_close(
        moe.fused_experts(*few), cpu_experts.fused_experts(*few), rtol=0, atol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("renormalize", [True, False])
def test_compiled_softmax_routing_matches_the_torch_path(dtype, renormalize, monkeypatch):
    gen, seed = fresh_generator()
    logits = torch.randn(70, 12, generator=gen).to(dtype)
    routing = dict(renormalize=renormalize, routed_scaling_factor=1.5)
    weights, ids = moe.select_experts(logits, 3, **routing)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)  # the torch path
    torch_weights, torch_ids = moe.select_experts(logits, 3, **routing)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    # Best first, equal weights; among equal logits (frequent in bfloat16) either expert may be
    # chosen, so the ids are checked through their scores.
    torch.testing.assert_close(weights, torch_weights, rtol=1e-6, atol=1e-7, msg=f"seed {seed}")
    assert (weights[:, :-1] >= weights[:, 1:]).all()
    chosen, torch_chosen = logits.gather(1, ids), logits.gather(1, torch_ids)
    assert torch.equal(chosen, torch_chosen), f"seed {seed}"
    assert all(len(set(row)) == 3 for row in ids.tolist())
    if dtype == torch.float32:  # distinct logits: the very same experts
        assert torch.equal(ids, torch_ids), f"seed {seed}"
