"""Rooflines for the CPU benchmarks: what the memory and the matmul library allow, measured in the
benchmark's own run (same machine, same hour, same threads), as gpt-fast prints bandwidth beside
tokens/s.

- ``triad_bandwidth``: a STREAM-like triad ``a = b + s * c`` over arrays far larger than the
  caches, on torch's intra-op threads; bytes counted as STREAM does (two reads, one write).
- ``read_bandwidth``: a streaming sum over a large bfloat16 array, read-only as a decode step
  reads its weights.
- ``BandwidthProbe``: both, sampled between a benchmark's rounds and kept at their best over the
  whole run: the bandwidth drifts with the machine's load, and the best one is the roofline that
  never flatters the engine.
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
    return _best_triad(a, b, c, repeats)


def read_bandwidth(elements: int = 1 << 27, repeats: int = 8) -> float:
    """Best bytes/s of ``repeats`` sums over a bfloat16 array of ``elements`` (256 MiB by
    default): a read-only stream, as a decode step streams its weights."""
    return _best_read(torch.rand(elements).to(torch.bfloat16), repeats)


def _best_triad(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return 3 * a.numel() * a.element_size() / best


def _best_read(x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


class BandwidthProbe:
    """The best triad and read-only bandwidths of every ``sample`` in a run (arrays allocated
    once, beyond any last-level cache)."""

    def __init__(self, elements: int = 1 << 25, repeats: int = 4) -> None:
        self.triad_arrays = (torch.empty(elements), torch.rand(elements), torch.rand(elements))
        self.read_array = torch.rand(4 * elements).to(torch.bfloat16)
        self.repeats = repeats
        self.triad = 0.0
        self.read = 0.0
        torch.add(self.triad_arrays[1], self.triad_arrays[2], out=self.triad_arrays[0])

    def sample(self) -> tuple[float, float]:
        """This sample's (triad, read) bytes/s; the bests so far are ``triad`` and ``read``."""
        triad = _best_triad(*self.triad_arrays, repeats=self.repeats)
        read = _best_read(self.read_array, self.repeats)
        self.triad, self.read = max(self.triad, triad), max(self.read, read)
        return triad, read


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


def decode_roofline(
    tokens_per_s: float, bytes_per_token: float, bandwidth: float, read: float | None = None
) -> str:
    """``bytes per token, GB/s achieved, roofline tok/s, percent of it`` for a batch-1 decode
    (and the percent of a read-only bandwidth ``read`` where given)."""
    roof = bandwidth / bytes_per_token
    line = (
        f"{bytes_per_token / 1e6:8.1f} MB/token  {tokens_per_s * bytes_per_token / 1e9:6.1f} GB/s"
        f"  roofline {roof:6.1f} tok/s  {100 * tokens_per_s / roof:5.1f}% of it"
    )
    if read is not None:
        line += f"  ({100 * tokens_per_s * bytes_per_token / read:5.1f}% of the read bandwidth)"
    return line


def batched_roofline(flop_per_s: float, peak: float) -> str:
    """``GFLOP/s achieved, percent of the matmul peak`` for batched steps."""
    return f"{flop_per_s / 1e9:8.1f} GFLOP/s  {100 * flop_per_s / peak:5.1f}% of the matmul peak"
