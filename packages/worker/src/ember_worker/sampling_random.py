"""Counter-based random numbers for seeded requests.

A seeded request's random draw at a step is a pure function of (seed, number of output tokens so
far): an integer hash evaluated on tensors, with no generator state. So a seeded request samples
the same token whatever else is in the batch, on any device, and after preemption (it comes back
with the same output length). Unseeded rows use torch's default generator.
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


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row, determined by the row's (seed, step)."""
    seeds = seeds.to(torch.int64)
    key = _mix32((steps.to(torch.int64) & _MASK32) ^ _GOLDEN32)
    key = _mix32(key ^ (seeds & _MASK32))
    high = _mix32(key ^ ((seeds >> 32) & _MASK32))
    low = _mix32(high ^ _GOLDEN32)
    # 48 random bits: exact in float64, and never 0 or 1.
    bits = (high << 16) | (low >> 16)
    return (bits.to(torch.float64) + 0.5) * 2.0**-48
