"""GPU mixture-of-experts and LoRA kernels: time, achieved rate and the torch path they replace.

- **Fused MoE** (``moe.fused_experts`` on CUDA tensors: the Triton grouped matmul), bf16, a
  Mixtral-8x7B layer (hidden 4096, expert intermediate 14336, 8 experts, top 2) and a
  Qwen-MoE-like one (hidden 2048, intermediate 1408, 64 experts, top 8), from 1 to 4,096 tokens.
  Baseline: the torch path (``moe.torch_experts``: one matmul per expert present, cuBLAS) on the
  same stacked weights. The rate is the experts' FLOPs over the time (as a fraction of a large
  bf16 cuBLAS matmul measured in the same run) and, for few tokens, the expert weight bytes
  read (as a fraction of the device's copy bandwidth): decode-sized batches are bound by
  reading the weights of the experts they touch.
- **LoRA** (``lora.lora_shrink`` + ``lora.lora_expand`` on CUDA: the Triton row-group kernels,
  or the per-row ones for a few rows per adapter), bf16, rank 16, 4096 -> 4096, 16 adapters
  spread round robin over 16 to 4,096 rows. Baseline: the torch path (one matmul per adapter
  present). Both are checked against each other before timing.

Times are medians of CUDA-event-timed calls after warm-up.

    python3 packages/attention-kernels/benchmarks/bench_gpu_kernels.py [--repeats 30]

Exits with a message (status 0) where no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_gpu_decode import copy_bandwidth, cuda_time

from ember_kernels import lora, moe
from ember_kernels.moe import torch_experts
from ember_kernels.torch_ops import lora as torch_lora

# name -> (hidden, expert intermediate, experts, top_k)
MOE_LAYERS = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen-moe-like": (2048, 1408, 64, 8)}
MOE_TOKENS = (1, 16, 128, 1024, 4096)
LORA_ROWS = (16, 128, 1024, 4096)


def matmul_peak(dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an 8192^3 cuBLAS matmul at ``dtype``."""
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    return 2 * 8192**3 / cuda_time(lambda: a @ b, repeats)


def bench_moe(name, hidden, inter, experts, top_k, tokens, repeats, peak_flops, peak_bw):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dt, generator=gen) * 0.02
    x = torch.randn(tokens, hidden, device="cuda", dtype=dt, generator=gen)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = moe.select_experts(logits, top_k, renormalize=True)

    def triton_path():
        return moe.fused_experts(x, w13, w2, weights, ids)

    def torch_path():
        return torch_experts.fused_experts(x, w13, w2, weights, ids, None)

    got, want = triton_path().float(), torch_path().float()
    err = ((got - want).norm() / want.norm()).item()
    if not err < 2e-2:
        raise AssertionError(f"{name} {tokens} tokens: relative error {err:.2e}")
    t_triton, t_torch = cuda_time(triton_path, repeats), cuda_time(torch_path, repeats)
    flops = 2 * tokens * top_k * 3 * hidden * inter
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * hidden * inter * 2
    print(
        f"{name:>14} {tokens:>6} {t_triton * 1e6:>9.1f} {t_torch * 1e6:>9.1f} "
        f"{t_torch / t_triton:>7.2f}x {flops / t_triton / 1e12:>8.1f} "
        f"{flops / t_triton / peak_flops:>6.0%} {weight_bytes / t_triton / peak_bw:>7.0%} {err:>8.1e}"
    )


def bench_lora(rows, repeats, slots=16, rank=16, features=4096):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    a = torch.randn(slots, rank, features, device="cuda", dtype=dt, generator=gen) * 0.05
    b = torch.randn(slots, features, rank, device="cuda", dtype=dt, generator=gen) * 0.05
    x = torch.randn(rows, features, device="cuda", dtype=dt, generator=gen)
    y = torch.zeros(rows, features, device="cuda", dtype=dt)
    slot_of = torch.arange(rows, device="cuda", dtype=torch.int64) % slots
    mapping = lora.LoRAMapping(slot_of, slots)
    h = torch.empty(rows, rank, device="cuda", dtype=dt)

    def triton_path():
        lora.lora_shrink(x, a, mapping, 0.5, out=h)
        return lora.lora_expand(y, h, b, mapping)

    def torch_path():
        groups = mapping.groups()
        torch_lora.lora_shrink(x, a, groups, 0.5, h)
        return torch_lora.lora_expand(y, h, b, groups, 0, 0)

    y.zero_()
    got = triton_path().float().clone()
    y.zero_()
    want = torch_path().float().clone()
    err = ((got - want).norm() / want.norm()).item()
    if not err < 2e-2:
        raise AssertionError(f"lora {rows} rows: relative error {err:.2e}")
    t_triton, t_torch = cuda_time(triton_path, repeats), cuda_time(torch_path, repeats)
    print(
        f"{rows:>6} {t_triton * 1e6:>9.1f} {t_torch * 1e6:>9.1f} {t_torch / t_triton:>7.2f}x "
        f"{err:>8.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_kernels: no CUDA device here; nothing to measure.")
        return
    peak_bw = copy_bandwidth(ns.repeats)
    peak_flops = matmul_peak(torch.bfloat16, ns.repeats)
    print(
        f"{torch.cuda.get_device_name()}: copy {peak_bw / 1e9:.0f} GB/s, bf16 matmul "
        f"{peak_flops / 1e12:.0f} TFLOP/s"
    )
    print("fused MoE, bf16 (rate: TFLOP/s and of matmul peak; bytes: touched experts' weights)")
    print(
        f"{'layer':>14} {'tokens':>6} {'triton us':>9} {'torch us':>9} {'speedup':>8} "
        f"{'TFLOP/s':>8} {'of mm':>6} {'of copy':>7} {'rel err':>8}"
    )
    for name, (hidden, inter, experts, top_k) in MOE_LAYERS.items():
        for tokens in MOE_TOKENS:
            try:
                bench_moe(
                    name, hidden, inter, experts, top_k, tokens, ns.repeats, peak_flops, peak_bw
                )
            except Exception as exc:  # one failing size must not hide the others' figures
                print(f"{name:>14} {tokens:>6} FAILED: {type(exc).__name__}: {exc}")
    print("LoRA shrink + expand, bf16, rank 16, 4096 -> 4096, 16 adapters round robin")
    print(f"{'rows':>6} {'triton us':>9} {'torch us':>9} {'speedup':>8} {'rel err':>8}")
    for rows in LORA_ROWS:
        try:
            bench_lora(rows, ns.repeats)
        except Exception as exc:
            print(f"{rows:>6} FAILED: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
