"""LoRA shrink and expand in torch: one matmul per adapter present in the batch, on the rows that
use it (``ember_kernels.lora`` groups them; ``rows`` None means every row)."""

from __future__ import annotations

import torch


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    groups: list[tuple[int, torch.Tensor | None]],
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    if not (len(groups) == 1 and groups[0][1] is None):
        out.zero_()
    for slot, rows in groups:
        a = lora_a[slot].t()
        if rows is None:
            torch.matmul(x, a, out=out)
        else:
            out.index_copy_(0, rows, x.index_select(0, rows) @ a)
    if scale != 1.0:
        out.mul_(scale)
    return out


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    groups: list[tuple[int, torch.Tensor | None]],
    y_offset: int,
    h_offset: int,
) -> torch.Tensor:
    target = y.narrow(1, y_offset, lora_b.shape[1])
    h = h.narrow(1, h_offset, lora_b.shape[2])
    for slot, rows in groups:
        b = lora_b[slot].t()
        if rows is None:
            target.add_(h @ b)
        else:
            target.index_add_(0, rows, h.index_select(0, rows) @ b)
    return y
