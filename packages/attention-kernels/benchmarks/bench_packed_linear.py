"""Linear layers on oneDNN-packed weights (``packed_linear``) against torch's ``F.linear``.

A decoder's projections in float32 or bfloat16 (``--dtype``), shaped for the peer benchmark's tiny
Llama (hidden 256, intermediate 512, vocabulary 8192), its wide one (hidden 512, intermediate 1536)
and a Qwen2.5-0.5B-shaped model (hidden 896, 14/2 heads, intermediate 4864, vocabulary 151936),
at 1, 8, 64, 512 and 2,048 tokens (``--tokens``): the fused q/k/v, the output projection, gate/up,
down and the LM head. Three ways to the same product, timed interleaved in one run (each variant
in turn, best of ``--rounds``), with torch's threads as the engine sets them (every core) unless
``--threads``, as wall time per call:
  torch:  ``F.linear`` on the weight as the worker keeps it (input-major, same dtype), what the
          engine runs on an unpacked weight and what transformers runs (MKL in float32);
  plain:  oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``) on the plain ``[out, in]``
          weight, reordered by nobody (what a tied LM head could run without a packed copy);
  packed: ``packed_linear.linear`` on the weight packed once (``pack_linear_weight``).
Prints GFLOP/s of each and packed / torch (above 1: packed faster).

    python3 packages/attention-kernels/benchmarks/bench_packed_linear.py [--repeats 30]
        [--dtype bfloat16] [--models tiny,wide,0.5b] [--tokens 1,8,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ember_kernels.packed_linear import linear, pack_linear_weight

# hidden, heads, kv heads, intermediate, vocabulary
MODELS = {
    "tiny": (256, 4, 2, 512, 8192),
    "wide": (512, 8, 2, 1536, 8192),
    "0.5b": (896, 14, 2, 4864, 151936),
}
HEAD = 64
TOKENS = (1, 8, 64, 512, 2048)


def projections(
    hidden: int, heads: int, kv_heads: int, inter: int, vocab: int
) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features)."""
    return {
        "qkv": (hidden, (heads + 2 * kv_heads) * HEAD),
        "o_proj": (heads * HEAD, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
        "lm_head": (hidden, vocab),
    }


def onednn_on_plain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def best_per_call_ms(
    variants: dict[str, tuple], x: torch.Tensor, repeats: int, rounds: int
) -> dict[str, float]:
    """Per call, ms: each variant ``(fn, weight)`` runs ``repeats`` calls in turn, ``rounds``
    times over; the best round of each counts (the others are the machine's noise)."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, (fn, weight) in variants.items():
            fn(x, weight)
            start = time.perf_counter()
            for _ in range(repeats):
                fn(x, weight)
            best[name] = min(best[name], (time.perf_counter() - start) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--models", default="tiny,wide", help=f"of {','.join(MODELS)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    token_counts = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(
        f"{args.dtype}, torch threads {torch.get_num_threads()}; "
        "GFLOP/s torch / oneDNN on the plain weight / packed, packed / torch"
    )
    for model in args.models.split(","):
        print(f"\n{model}: " + " ".join(f"{t:>24}" for t in token_counts))
        for name, (n_in, n_out) in projections(*MODELS[model]).items():
            weight = torch.randn(n_in, n_out, generator=gen).to(dtype).t()  # input-major
            variants = {
                "torch": (F.linear, weight),
                "plain": (onednn_on_plain, weight.contiguous()),
                "packed": (linear, pack_linear_weight(weight)),
            }
            cells = []
            for tokens in token_counts:
                x = torch.randn(tokens, n_in, generator=gen).to(dtype)
                work = tokens * n_in * n_out / (896 * 896)  # fewer repeats for big matmuls
                repeats = max(3, min(args.repeats * 64 // max(tokens, 64), int(200 / work)))
                ms = best_per_call_ms(variants, x, repeats, args.rounds)
                gflop = 2 * tokens * n_in * n_out / 1e6
                rates = "/".join(f"{gflop / ms[v]:.0f}" for v in variants)
                cells.append(f"{rates} {ms['torch'] / ms['packed']:5.2f}x")
            print(f"{name:8} " + " ".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
