"""Rooflines for the CPU benchmarks: what the memory and the matmul library allow, measured in the
benchmark's own run (same machine, same hour, same threads), as gpt-fast prints bandwidth beside
tokens/s.

- ``triad_bandwidth``: a STREAM-like triad ``a = b + s * c`` over arrays far larger than the
  caches, on torch's intra-op threads; bytes counted as STREAM does (two reads, one write).
- ``matmul_peak``: the FLOP/s of the CPU matmul Ember uses at that dtype (oneDNN on a packed
  weight where it packs one, else torch's ``F.linear``), on a large square-ish problem.
- ``decode_roofline`` / ``batched_roofline``: one line each, for a batch-1 decode (bytes read per
  token against the bandwidth) and a batched step (FLOP/s against the peak).
"""

from __future__ import annotations

import time

import torch

from ember_kernels.packed_linear import can_pack_linear_weight, linear, pack_linear_weight


def triad_bandwidth(elements: int = 1 << 25, repeats: int = 8) -> float:
    """Best bytes/s of ``repeats`` triads over three float32 arrays of ``elements`` (128 MiB each
    by default: beyond any last-level cache)."""
    b = torch.rand(elements)
    c = torch.rand(elements)
    a = torch.empty(elements)
    torch.add(b, c, alpha=3.0, out=a)  # first touch of ``a``
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return 3 * elements * a.element_size() / best


def matmul_peak(dtype: torch.dtype, tokens: int = 512, size: int = 4096, repeats: int = 5) -> float:
    """Best FLOP/s of ``[tokens, size] x [size, size]^T`` at ``dtype`` through the matmul the
    engine runs (oneDNN on a packed weight where ``packed_linear`` packs one)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(size, size, generator=gen).to(dtype)
    if can_pack_linear_weight(weight):
        weight = pack_linear_weight(weight)
    x = torch.randn(tokens, size, generator=gen).to(dtype)
    linear(x, weight)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        linear(x, weight)
        best = min(best, time.perf_counter() - start)
    return 2 * tokens * size * size / best


def decode_roofline(tokens_per_s: float, bytes_per_token: float, bandwidth: float) -> str:
    """``bytes per token, GB/s achieved, roofline tok/s, percent of it`` for a batch-1 decode."""
    roof = bandwidth / bytes_per_token
    return (
        f"{bytes_per_token / 1e6:8.1f} MB/token  {tokens_per_s * bytes_per_token / 1e9:6.1f} GB/s"
        f"  roofline {roof:6.1f} tok/s  {100 * tokens_per_s / roof:5.1f}% of it"
    )


def batched_roofline(flop_per_s: float, peak: float) -> str:
    """``GFLOP/s achieved, percent of the matmul peak`` for batched steps."""
    return f"{flop_per_s / 1e9:8.1f} GFLOP/s  {100 * flop_per_s / peak:5.1f}% of the matmul peak"
