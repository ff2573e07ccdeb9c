"""Segmented low-rank (LoRA) matmuls for a batch whose rows use different adapters.

Every adapter of a layer sits in one slot of two stacked tensors: ``lora_a [slots, rank, in]``
and ``lora_b [slots, out, rank]``, zero-padded to the largest rank (padding adds nothing). A
batch names the slot of each row (``-1``: no adapter), and the low-rank delta runs in two steps,
as in Punica and S-LoRA: ``lora_shrink`` (``h = scale * x A[slot]^T``, a few columns per row)
and ``lora_expand`` (``y += h B[slot]^T``, into any column range of ``y`` so that the slices of a
fused projection share one shrink). CUDA tensors run the Triton kernels: per row
(``triton_ops.lora``) for a few rows per adapter, else by row groups, one small matrix product
per tile of an adapter's rows (``triton_ops.lora_segment``; the crossing point is the CPU's,
not measured on a GPU). Other tensors run the torch path of ``ember_kernels.torch_ops.lora``,
which groups the rows by slot once per batch (``LoRAMapping``) and runs one matmul per adapter
present (no loop over rows or requests), except that batches of a few rows per adapter
(decoding) run the compiled row-by-row kernels of ``ember_kernels.cpu_ops`` where they are built:
there each adapter's matmul would cost more in calls than in arithmetic. ``lora_b`` may be the
transpose of a ``[slots, rank, out]`` tensor, the layout the compiled expand reads fastest.
"""

from __future__ import annotations

import torch

from ember_kernels import cpu_ops
from ember_kernels.torch_ops import lora as _torch_lora

# Rows per adapter present at or below which the compiled row-by-row kernels beat one matmul per
# adapter (``benchmarks/bench_lora_kernels.py``: with B in the worker's layout, about 32 in
# float32 and bfloat16).
COMPILED_MAX_ROWS_PER_ADAPTER = 32


class LoRAMapping:
    """Which adapter slot each row of a batch uses (``slot_indices [rows]``, ``-1`` for none),
    with the rows grouped by slot on first use; build it once per batch and pass it to every
    layer's ``lora_shrink``/``lora_expand``."""

    def __init__(self, slot_indices: torch.Tensor, num_slots: int) -> None:
        if slot_indices.dim() != 1 or slot_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError("slot_indices: expected a 1-D int32 or int64 tensor")
        if num_slots < 1:
            raise ValueError(f"num_slots: must be at least 1, got {num_slots}")
        self.slot_indices = slot_indices
        self.num_slots = num_slots
        self._groups: list[tuple[int, torch.Tensor | None]] | None = None
        self._segments: tuple[torch.Tensor, torch.Tensor] | None = None
        self._few_rows_per_adapter: bool | None = None

    @property
    def num_rows(self) -> int:
        return self.slot_indices.shape[0]

    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """``(slot, rows)`` for each slot that some row uses; ``rows`` is None where every row
        of the batch uses that slot (no gather needed). One host sync, on first use."""
        if self._groups is None:
            self._groups = _group_rows(self.slot_indices, self.num_slots)
        return self._groups

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(order, bounds)`` for the Triton segment kernels: the rows sorted by slot (stable,
        rows without an adapter first) and where each slot's rows start (slot ``s`` owns
        ``order[bounds[s + 1]:bounds[s + 2]]``), computed on the slots' device without a host
        sync, on first use."""
        if self._segments is None:
            slots = self.slot_indices.long()
            counts = torch.zeros(self.num_slots + 1, dtype=torch.int64, device=slots.device)
            counts.index_add_(0, slots + 1, torch.ones_like(slots))
            bounds = torch.zeros(self.num_slots + 2, dtype=torch.int64, device=slots.device)
            torch.cumsum(counts, 0, out=bounds[1:])
            self._segments = (torch.argsort(slots, stable=True), bounds)
        return self._segments

    def runs_compiled(self, x: torch.Tensor) -> bool:
        """Whether the compiled row-by-row CPU kernels serve this batch of rows like ``x``: CPU
        rows of a dtype they take, a few per adapter present."""
        if x.dtype not in cpu_ops.DTYPES or x.device.type != "cpu" or not cpu_ops.available():
            return False
        return self.few_rows_per_adapter()

    def few_rows_per_adapter(self) -> bool:
        """At most ``COMPILED_MAX_ROWS_PER_ADAPTER`` rows per adapter present on average
        (decoding): the per-row kernels' batches, CPU or Triton; more rows per adapter run one
        matmul per adapter (torch) or the Triton segment kernels."""
        if self._few_rows_per_adapter is None:
            groups = self.groups()
            rows = sum(self.num_rows if r is None else r.numel() for _, r in groups)
            self._few_rows_per_adapter = bool(groups) and (
                rows <= COMPILED_MAX_ROWS_PER_ADAPTER * len(groups)
            )
        return self._few_rows_per_adapter


def _group_rows(slots: torch.Tensor, num_slots: int) -> list[tuple[int, torch.Tensor | None]]:
    if slots.numel() == 0:
        return []
    slots = slots.long()
    if int(slots.min()) < -1 or int(slots.max()) >= num_slots:
        raise ValueError(f"slot_indices: every slot must be -1 or in [0, {num_slots})")
    # Rows without an adapter count in bin 0 and sort first; the others follow slot by slot.
    counts = torch.bincount(slots + 1, minlength=num_slots + 1).tolist()
    if counts[0] == 0 and max(counts) == slots.numel():
        return [(counts.index(slots.numel()) - 1, None)]
    order = torch.argsort(slots, stable=True)
    groups, start = [], counts[0]
    for slot, count in enumerate(counts[1:]):
        if count:
            groups.append((slot, order[start : start + count]))
            start += count
    return groups


def _check(x: torch.Tensor, stacked: torch.Tensor, mapping: LoRAMapping, name: str) -> None:
    if x.dim() != 2 or stacked.dim() != 3:
        raise ValueError(f"{name}: expected 2-D rows and a 3-D [slots, ., .] stack")
    if x.shape[0] != mapping.num_rows:
        raise ValueError(f"{name}: {x.shape[0]} rows but {mapping.num_rows} slot indices")
    if stacked.shape[0] != mapping.num_slots:
        raise ValueError(
            f"{name}: {stacked.shape[0]} slots stacked, the mapping has {mapping.num_slots}"
        )


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    mapping: LoRAMapping,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = scale * lora_a[slot[t]] @ x[t]`` for ``x [rows, in]``, ``lora_a
    [slots, rank, in]``; rows without an adapter get zeros. Returns ``out [rows, rank]``."""
    _check(x, lora_a, mapping, "lora_shrink")
    if x.shape[1] != lora_a.shape[2]:
        raise ValueError(
            f"lora_shrink: x has {x.shape[1]} features, lora_a takes {lora_a.shape[2]}"
        )
    shape = (x.shape[0], lora_a.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor of shape {shape}")
    if x.is_cuda:
        from ember_kernels.triton_ops import lora as triton_lora
        from ember_kernels.triton_ops import lora_segment

        if not mapping.few_rows_per_adapter():
            return lora_segment.lora_shrink(x, lora_a, *mapping.segments(), scale, out)
        return triton_lora.lora_shrink(x, lora_a, mapping.slot_indices, scale, out)
    if mapping.runs_compiled(x) and lora_a.dtype == out.dtype == x.dtype:
        return cpu_ops.lora_shrink(x, lora_a, mapping.slot_indices, scale, out)
    return _torch_lora.lora_shrink(x, lora_a, mapping.groups(), scale, out)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoRAMapping,
    *,
    y_offset: int = 0,
    h_offset: int = 0,
) -> torch.Tensor:
    """``y[t, y_offset:y_offset+out] += lora_b[slot[t]] @ h[t, h_offset:h_offset+rank]`` in
    place for ``lora_b [slots, out, rank]``; rows without an adapter are left alone. Returns
    ``y``."""
    _check(h, lora_b, mapping, "lora_expand")
    n, r = lora_b.shape[1], lora_b.shape[2]
    if y.dim() != 2 or y.shape[0] != h.shape[0]:
        raise ValueError("lora_expand: y must be 2-D with one row per row of h")
    if y_offset < 0 or y_offset + n > y.shape[1] or h_offset < 0 or h_offset + r > h.shape[1]:
        raise ValueError(
            f"lora_expand: columns [{y_offset}, {y_offset + n}) of y or [{h_offset}, "
            f"{h_offset + r}) of h out of range"
        )
    if y.is_cuda:
        from ember_kernels.triton_ops import lora as triton_lora
        from ember_kernels.triton_ops import lora_segment

        if not mapping.few_rows_per_adapter():
            segments = mapping.segments()
            return lora_segment.lora_expand(y, h, lora_b, *segments, y_offset, h_offset)
        return triton_lora.lora_expand(y, h, lora_b, mapping.slot_indices, y_offset, h_offset)
    if mapping.runs_compiled(y) and h.dtype == lora_b.dtype == y.dtype and y.stride(1) == 1:
        return cpu_ops.lora_expand(y, h, lora_b, mapping.slot_indices, y_offset, h_offset)
    return _torch_lora.lora_expand(y, h, lora_b, mapping.groups(), y_offset, h_offset)
