"""Segmented LoRA shrink/expand (torch path and Triton) against the row-by-row reference."""

from __future__ import annotations

import pytest
import torch
from ek_inputs import TOLERANCES, TRITON, fresh_generator

from ember_kernels import cpu_ops, lora, torch_ops, triton_ops
from ember_kernels.lora import LoRAMapping, lora_expand, lora_shrink
from ember_kernels.reference import lora_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def torch_backend(x, lora_a, lora_b, slots, scale, y):
    mapping = LoRAMapping(slots, lora_a.shape[0])
    h = lora_shrink(x, lora_a, mapping, scale)
    return lora_expand(y, h, lora_b, mapping)


def segmented_backend(x, lora_a, lora_b, slots, scale, y):
    groups = LoRAMapping(slots, lora_a.shape[0]).groups()
    h = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype)
    torch_ops.lora.lora_shrink(x, lora_a, groups, scale, h)
    return torch_ops.lora.lora_expand(y, h, lora_b, groups, 0, 0)


def triton_backend(x, lora_a, lora_b, slots, scale, y):
    h = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32)
    h = TRITON.lora.lora_shrink(x, lora_a, slots, scale, h)
    return TRITON.lora.lora_expand(y, h, lora_b, slots, 0, 0)


def triton_segment_backend(x, lora_a, lora_b, slots, scale, y):
    order, bounds = LoRAMapping(slots, lora_a.shape[0]).segments()
    h = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32)
    h = TRITON.lora_segment.lora_shrink(x, lora_a, order, bounds, scale, h)
    return TRITON.lora_segment.lora_expand(y, h, lora_b, order, bounds, 0, 0)


def compiled_backend(x, lora_a, lora_b, slots, scale, y):
    h = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype)
    cpu_ops.lora_shrink(x, lora_a, slots, scale, h)
    return cpu_ops.lora_expand(y, h, lora_b, slots, 0, 0)


BACKENDS = [
    pytest.param(torch_backend, id="dispatch"),
    pytest.param(segmented_backend, id="torch"),
    pytest.param(triton_backend, id="triton"),
    pytest.param(triton_segment_backend, id="triton-segment"),
    pytest.param(
        compiled_backend,
        id="compiled",
        marks=pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here"),
    ),
]


def stacks(num_slots, rank, k, n, dtype, gen):
    lora_a = torch.randn(num_slots, rank, k, generator=gen).to(dtype)
    lora_b = torch.randn(num_slots, n, rank, generator=gen).to(dtype) / rank
    return lora_a, lora_b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "slot_list",
    [[0, -1, 2, 2, 1, -1, 0, 3, 2], [1, 1, 1], [-1, -1], [3], []],
    ids=["mixed", "one-adapter", "none", "single-row", "empty"],
)
@pytest.mark.parametrize("b_layout", ["out-major", "rank-major"])
def test_shrink_expand_matches_reference(backend, dtype, slot_list, b_layout):
    """B as a contiguous [slots, out, rank] or as the transpose of a contiguous [slots, rank,
    out] (the worker's layout)."""
    gen, seed = fresh_generator()
    k, n, rank, num_slots = 96, 80, 8, 4
    x = torch.randn(len(slot_list), k, generator=gen).to(dtype)
    lora_a, lora_b = stacks(num_slots, rank, k, n, dtype, gen)
    if b_layout == "rank-major":
        lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    slots = torch.tensor(slot_list, dtype=torch.int32)
    base = torch.randn(len(slot_list), n, generator=gen).to(dtype)
    y = backend(x, lora_a, lora_b, slots, 0.5, base.clone())
    expected = base.double() + lora_reference(
        x.double(), lora_a.double(), lora_b.double(), slots, 0.5
    )
    tol = TOLERANCES[dtype] if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(y.double(), expected, **tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_expand_into_column_slices(use_triton):
    """Slices of a fused projection: one shrink of the concatenated A, one expand per slice."""
    gen, seed = fresh_generator()
    k, rank, sizes, num_slots = 64, 4, [48, 16, 16], 3
    slots = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int64)
    x = torch.randn(5, k, generator=gen)
    parts = [stacks(num_slots, rank, k, n, torch.float32, gen) for n in sizes]
    a_cat = torch.cat([a for a, _ in parts], dim=1)
    y = torch.zeros(5, sum(sizes))
    if use_triton:
        h = TRITON.lora.lora_shrink(x, a_cat, slots, 2.0, torch.empty(5, a_cat.shape[1]))
    else:
        mapping = LoRAMapping(slots, num_slots)
        h = lora_shrink(x, a_cat, mapping, 2.0)
    offset = 0
    for i, (_, b) in enumerate(parts):
        if use_triton:
            TRITON.lora.lora_expand(y, h, b, slots, offset, i * rank)
        else:
            lora_expand(y, h, b, mapping, y_offset=offset, h_offset=i * rank)
        offset += b.shape[1]
    expected = torch.cat([lora_reference(x, a, b, slots, 2.0) for a, b in parts], dim=1)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


def test_zero_padded_ranks_add_nothing():
    """An adapter of a smaller rank in a larger slot: the padding rows/columns are zeros."""
    gen, _ = fresh_generator()
    x = torch.randn(3, 32, generator=gen)
    a_small, b_small = torch.randn(2, 32, generator=gen), torch.randn(24, 2, generator=gen)
    lora_a, lora_b = torch.zeros(1, 8, 32), torch.zeros(1, 24, 8)
    lora_a[0, :2], lora_b[0, :, :2] = a_small, b_small
    mapping = LoRAMapping(torch.zeros(3, dtype=torch.int64), 1)
    y = lora_expand(torch.zeros(3, 24), lora_shrink(x, lora_a, mapping), lora_b, mapping)
    torch.testing.assert_close(y, x @ a_small.t() @ b_small.t(), rtol=1e-5, atol=1e-5)


def test_mapping_groups_rows_by_slot():
    mapping = LoRAMapping(torch.tensor([1, -1, 0, 1, 0]), 3)
    groups = [(slot, rows.tolist()) for slot, rows in mapping.groups()]
    assert groups == [(0, [2, 4]), (1, [0, 3])]
    assert LoRAMapping(torch.tensor([2, 2]), 3).groups() == [(2, None)]
    order, bounds = mapping.segments()
    assert order.tolist() == [1, 2, 4, 0, 3] and bounds.tolist() == [0, 1, 3, 5, 5]


@pytest.mark.parametrize("rows_per_adapter", [1, 17, 40])
def test_segment_kernels_tile_long_segments(rows_per_adapter):
    """Segments longer than one row tile (16 rows), rows of each slot interleaved with others',
    a rank below the tile's 16 and B in the worker's layout: the Triton segment kernels equal the
    row-by-row reference."""
    gen, seed = fresh_generator()
    k, n, rank, num_slots = 40, 24, 4, 3
    slots = torch.arange(num_slots * rows_per_adapter) % (num_slots + 1) - 1
    slots = slots[torch.randperm(slots.numel(), generator=gen)]
    x = torch.randn(slots.numel(), k, generator=gen)
    lora_a, lora_b = stacks(num_slots, rank, k, n, torch.float32, gen)
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    base = torch.randn(slots.numel(), n, generator=gen)
    y = triton_segment_backend(x, lora_a, lora_b, slots, 2.0, base.clone())
    expected = base + lora_reference(x, lora_a, lora_b, slots, 2.0)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="slot_indices"):
        LoRAMapping(torch.tensor([0.5]), 2)
    with pytest.raises(ValueError, match="slot_indices"):
        LoRAMapping(torch.tensor([0, 2]), 2).groups()
    mapping = LoRAMapping(torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="features"):
        lora_shrink(torch.zeros(2, 8), torch.zeros(2, 4, 9), mapping)
    with pytest.raises(ValueError, match="rows"):
        lora_shrink(torch.zeros(3, 8), torch.zeros(2, 4, 8), mapping)
    with pytest.raises(ValueError, match="out of range"):
        lora_expand(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(2, 8, 4), mapping, y_offset=1)


def test_modules_are_exported():
    assert lora.lora_shrink is lora_shrink
    assert callable(torch_ops.lora.lora_expand) and callable(triton_ops.lora.lora_expand)
    assert callable(triton_ops.lora_segment.lora_expand)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")
def test_few_rows_per_adapter_run_the_compiled_kernels():
    x = torch.zeros(64, 8)
    limit = lora.COMPILED_MAX_ROWS_PER_ADAPTER
    assert LoRAMapping(torch.arange(64) % 4, 4).runs_compiled(x)  # 16 rows per adapter
    assert not LoRAMapping(torch.zeros(limit + 1, dtype=torch.int64), 4).runs_compiled(x)
    assert LoRAMapping(torch.arange(64) % 4, 4).runs_compiled(x.bfloat16())
    assert not LoRAMapping(torch.arange(64) % 4, 4).runs_compiled(x.double())
    assert not LoRAMapping(torch.full((64,), -1), 4).runs_compiled(x)
