"""Counter-based random numbers for seeded requests.

A seeded request's noise at a step is a pure function of (seed, number of output tokens so far,
token id): an integer hash evaluated on tensors, with no generator state. So a seeded request
samples the same token whatever else is in the batch, on any device, and after preemption (it
comes back with the same output length). Unseeded rows use torch's default generator.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finalizer on int64 tensors holding values in [0, 2**32).

    int64 products wrap modulo 2**64, which keeps their low 32 bits exact; masking back to 32 bits
    keeps every value non-negative, so right shifts are logical.
    """
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def seeded_exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise ``[len(seeds), vocab_size]`` determined by each row's (seed, step)."""
    seeds = seeds.to(torch.int64)
    steps = steps.to(torch.int64)
    key = _mix32((steps & _MASK32) ^ _GOLDEN32)
    key = _mix32(key ^ (seeds & _MASK32))
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _mix32((key[:, None] + token * _GOLDEN32) & _MASK32)
    bits = _mix32(bits ^ key[:, None])
    # 24 random bits give a uniform in (0, 1) exactly representable in float32.
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)
