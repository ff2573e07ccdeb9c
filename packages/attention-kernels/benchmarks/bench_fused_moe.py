"""The mixture-of-experts layer (``ember_kernels.moe.fused_moe``) against a per-expert Python loop
and transformers' Mixtral MoE block, on the same weights and tokens, interleaved in one run.

Routing (softmax top-k, renormalized) plus the experts on the CPU (``--dtype``, float32 by
default), for a Mixtral-like layer (8 experts, 2 per token) and a finer-grained Qwen-MoE-like one
(32 experts, 4 per token), at 1 to 512 tokens (``--tokens``). Columns: ember's layer on stacked
weights (the compiled kernel of ``moe.cpu_experts`` for a few tokens, where it is built), the
torch path on the same stacked weights (one matmul per expert), on per-expert weights packed for
oneDNN (where they are large enough to pack), a loop that visits every expert
and masks its tokens with ``torch.where`` (the form MoE layers were first written in), and
transformers' ``MixtralSparseMoeBlock``. Every variant's output is checked against ember's first.
Wall time per call, best of three runs, torch's threads as they are.

    python3 packages/attention-kernels/benchmarks/bench_fused_moe.py [--repeats 20] [--tokens 1,64]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ember_kernels import moe
from ember_kernels.moe import torch_experts
from ember_kernels.packed_linear import can_pack_linear_weight, pack_linear_weight

# name -> (hidden, expert intermediate, experts, top_k)
LAYERS = {"mixtral-like": (512, 1024, 8, 2), "qwen-moe-like": (512, 256, 32, 4)}
TOKENS = (1, 4, 16, 32, 128, 512)
COLUMNS = ("ember", "torch", "packed", "loop", "hf")


def expert_loop(x, router, w13, w2, top_k):
    """Every expert in turn: the tokens that chose it, found by ``torch.where``."""
    weights, ids = moe.select_experts(F.linear(x, router), top_k, renormalize=True)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
    return out


def transformers_block(hidden, inter, experts, top_k, router, w13, w2):
    """transformers' Mixtral MoE block holding the same weights, or None without transformers."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    config = MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
        num_experts_per_tok=top_k,
    )  # fmt: skip
    block = MixtralSparseMoeBlock(config).eval().to(w13.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
    return lambda x: block(x[None])[0]


def layer_variants(hidden, inter, experts, top_k, router, w13, w2) -> dict:
    """label -> a function of the tokens (None where it cannot run here)."""
    packed = None
    if can_pack_linear_weight(w13[0]):
        packed = ([pack_linear_weight(w) for w in w13], [pack_linear_weight(w) for w in w2])

    def ember(x, w13=w13, w2=w2):
        return moe.fused_moe(x, w13, w2, F.linear(x, router), top_k, renormalize=True)

    def torch_path(x):
        weights, ids = moe.select_experts(F.linear(x, router), top_k, renormalize=True)
        return torch_experts.fused_experts(x, w13, w2, weights, ids)

    return {
        "ember": ember,
        "torch": torch_path,
        "packed": None if packed is None else lambda x: ember(x, *packed),
        "loop": lambda x: expert_loop(x, router, w13, w2, top_k),
        "hf": transformers_block(hidden, inter, experts, top_k, router, w13, w2),
    }


def per_call_ms(fn, x, repeats: int) -> float:
    best = float("inf")
    for _ in range(3):
        fn(x)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(x)
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(f"ms per call, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'layer':<14} {'tokens':>6}" + "".join(f"{c:>9}" for c in COLUMNS))
    for name, (hidden, inter, experts, top_k) in LAYERS.items():
        router = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
        variants = layer_variants(hidden, inter, experts, top_k, router, w13, w2)
        for n in tokens:
            x = torch.randn(n, hidden, generator=gen).to(dtype)
            expected = variants["ember"](x)
            cells = []
            for label, fn in variants.items():
                if fn is None:
                    cells.append(f"{'-':>9}")
                    continue
                # transformers' block routes on its own: in bfloat16 a near tie between two
                # experts' scores may go the other way, so only float32 checks it.
                if label != "hf" or dtype == torch.float32:
                    torch.testing.assert_close(fn(x), expected, rtol=tol, atol=tol, msg=label)
                cells.append(f"{per_call_ms(fn, x, args.repeats):>9.3f}")
            print(f"{name:<14} {n:>6}" + "".join(cells))


if __name__ == "__main__":
    main()
