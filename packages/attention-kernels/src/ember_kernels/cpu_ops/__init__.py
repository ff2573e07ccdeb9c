"""Compiled C++ kernels for CPU tensors (built on first use, see ``build``).

``available()`` says whether they could be built here; ``paged_attention`` takes the same
arguments as ``ember_kernels.paged_attention`` and raises ``RuntimeError`` where they could not.
"""

from __future__ import annotations

import torch

from ember_kernels.cpu_ops.build import load_library
from ember_kernels.validation import check_paged_attention_args


def available() -> bool:
    """Whether the compiled CPU kernels work here (the first call builds or loads them)."""
    return load_library() is not None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention read in place from the pages (see ``ember_kernels.paged_attention``).

    ``max_query_len`` / ``max_seq_len`` are accepted for signature parity; the kernel reads the
    lengths itself.
    """
    library = load_library()
    if library is None:
        raise RuntimeError("ember_kernels.cpu_ops: the compiled CPU kernels are unavailable here")
    check_paged_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, sliding_window, out
    )
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap: expected None or > 0, got {soft_cap}")
    if out is None:
        out = torch.empty_like(query)
    if query.stride(2) != 1:
        query = query.contiguous()
    library.paged_attention(
        query,
        key_cache.contiguous(),
        value_cache.contiguous(),
        block_table.to(torch.int32),
        query_start_loc.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        scale,
        sliding_window or 0,
        soft_cap or 0.0,
        out,
    )
    return out
