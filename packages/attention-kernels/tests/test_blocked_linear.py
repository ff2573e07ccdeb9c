"""Ember's streaming bfloat16 kernel at both block widths of oneDNN's packed layouts (64 where oneDNN
runs AVX512-BF16, 32 where it runs AMX), on plain tensors in those layouts
(``cpu_ops.blocked_linear``), against the kernel on oneDNN's packed bytes; the layout check; and the
per-CPU row cap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ek_inputs import fresh_generator

from ember_kernels import cpu_features, cpu_ops
from ember_kernels.cpu_features import cpu_flags, has_amx_bf16
from ember_kernels.packed_linear import BLOCK_WIDTHS, block_linear_weight, pack_linear_weight

needs_kernel = pytest.mark.skipif(
    not (
        "avx512_bf16" in cpu_flags()
        and torch.backends.mkldnn.is_available()
        and cpu_ops.available()
    ),
    reason="Ember's kernel needs AVX512-BF16 and the compiled CPU kernels",
)

ROWS = (1, 2, 3, 4, 5, 7, 13, 32)
# The Qwen2.5-0.5B projections (fused q/k/v, output, gate/up, down) and a few that fill one block.
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (64, 64), (128, 2), (192, 90)]


def reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_both_block_widths_equal_the_kernel_on_packed_bytes(out_features, in_features, bias):
    """Each output channel's sum runs over the input pairs in the same order at either width, so
    the plain blocked tensors give the bits the packed weight gives, up to a decode batch."""
    gen, seed = fresh_generator()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = pack_linear_weight(weight)
    blocked = {block: block_linear_weight(weight, block) for block in BLOCK_WIDTHS}
    width = cpu_ops.packed_block_width(packed)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        via_packed = cpu_ops.packed_linear(x, packed, b)
        runs_kernel = cpu_ops.packed_gemv_applies(x, packed, b)
        assert runs_kernel == (width != 0 and rows <= cpu_ops.packed_gemv_max_rows())
        for block, w in blocked.items():
            got = cpu_ops.blocked_linear(x, w, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            if runs_kernel:
                assert torch.equal(got, via_packed), f"block {block}, rows {rows}, seed {seed}"
            torch.testing.assert_close(
                got.double(), reference(x, weight, b), rtol=1e-2, atol=5e-2, msg=f"seed {seed}"
            )
        assert torch.equal(
            cpu_ops.blocked_linear(x, blocked[32], b), cpu_ops.blocked_linear(x, blocked[64], b)
        )


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 33, 40])
def test_blocked_linear_takes_any_rows_and_views(rows):
    """No cap on a plain blocked weight (above 4 rows the register tiles of 6, a ragged last tile
    included; an odd count of 32-wide blocks); rows of a view that starts mid-pair are copied."""
    gen, seed = fresh_generator()
    weight = torch.randn(224, 256, generator=gen).bfloat16()
    x = torch.randn(rows, 257, generator=gen).bfloat16()[:, 1:]
    w32 = block_linear_weight(weight, 32)
    got = cpu_ops.blocked_linear(x, w32)
    assert torch.equal(got, cpu_ops.blocked_linear(x.contiguous(), w32))
    torch.testing.assert_close(
        got.double(), reference(x, weight, None), rtol=1e-2, atol=5e-2, msg=f"seed {seed}"
    )
    three_d = cpu_ops.blocked_linear(x.reshape(1, rows, 256), w32)
    assert three_d.shape == (1, rows, 224) and torch.equal(three_d[0], got)


@needs_kernel
def test_the_layout_check_finds_the_width_of_the_bytes():
    """One check settles both widths: oneDNN's packed bytes (64 wide where it runs AVX512-BF16,
    32 wide with AMX), plain blocked tensors of either width, and nothing for a plain tensor,
    another layout, someone else's values, or values that fit several layouts (all equal)."""
    gen, _ = fresh_generator()
    weight = torch.randn(896, 896, generator=gen).bfloat16()
    assert cpu_ops.packed_block_width(pack_linear_weight(weight)) == (32 if has_amx_bf16() else 64)
    assert cpu_ops.packed_block_width(weight) == 0  # a plain tensor
    for block in BLOCK_WIDTHS:
        assert cpu_ops.block_width_of(weight, block_linear_weight(weight, block)) == block
    sixteen = weight.reshape(56, 16, 448, 2).transpose(1, 2).contiguous()
    other = torch.randn(896, 896, generator=gen).bfloat16()
    assert cpu_ops.block_width_of(weight, sixteen) == 0
    assert cpu_ops.block_width_of(weight, weight) == 0
    assert cpu_ops.block_width_of(weight, block_linear_weight(other, 64)) == 0
    ones = torch.ones(128, 64, dtype=torch.bfloat16)
    assert cpu_ops.block_width_of(ones, block_linear_weight(ones, 64)) == 0
    # a packed weight whose values fit several layouts is read right, and teaches nothing of its
    # shape: the next weight of that shape is checked on its own values
    constant = torch.full((320, 96), 0.5, dtype=torch.bfloat16)
    x = torch.randn(1, 96, generator=gen).bfloat16()
    got = cpu_ops.packed_linear(x, pack_linear_weight(constant), None)
    torch.testing.assert_close(got.double(), reference(x, constant, None), rtol=1e-2, atol=5e-2)
    later = torch.randn(320, 96, generator=gen).bfloat16()
    assert cpu_ops.packed_block_width(pack_linear_weight(later)) == (32 if has_amx_bf16() else 64)


@needs_kernel
def test_the_row_cap_is_this_cpus_choice_and_decides_the_path():
    """The compiled kernels hold the cap chosen from the CPU's flags (32, or 2 with AMX); a step
    above it runs oneDNN's matmul on the same packed weight."""
    assert cpu_ops.packed_gemv_max_rows() == cpu_features.packed_gemv_max_rows()
    gen, seed = fresh_generator()
    weight = torch.randn(256, 128, generator=gen).bfloat16()
    packed = pack_linear_weight(weight)
    x = torch.randn(5, 128, generator=gen).bfloat16()
    try:
        cpu_ops.set_packed_gemv_max_rows(4)
        assert cpu_ops.packed_gemv_applies(x[:4], packed)
        assert not cpu_ops.packed_gemv_applies(x, packed)
        torch.testing.assert_close(
            cpu_ops.packed_linear(x, packed, None).double(),
            reference(x, weight, None),
            rtol=1e-2,
            atol=5e-2,
            msg=f"seed {seed}",
        )
        with pytest.raises(ValueError, match="rows: "):
            cpu_ops.set_packed_gemv_max_rows(-1)
    finally:
        cpu_ops.set_packed_gemv_max_rows(cpu_features.packed_gemv_max_rows())


def test_the_cap_is_small_where_the_cpu_has_amx(monkeypatch):
    for amx, cap in ((True, cpu_features.PACKED_GEMV_MAX_ROWS_WITH_AMX),
                     (False, cpu_features.PACKED_GEMV_MAX_ROWS)):  # fmt: skip
        monkeypatch.setattr(cpu_features, "has_amx_bf16", lambda amx=amx: amx)
        assert cpu_features.packed_gemv_max_rows.__wrapped__() == cap
    assert cpu_features.PACKED_GEMV_MAX_ROWS_WITH_AMX < cpu_features.PACKED_GEMV_MAX_ROWS


def test_block_linear_weight_lays_out_pairs_per_block_and_refuses_others():
    weight = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4).bfloat16()
    blocked = block_linear_weight(weight, 32)
    assert blocked.shape == (2, 2, 32, 2) and blocked.is_contiguous()
    assert torch.equal(blocked[1, 1, 3], weight[32 + 3, 2:4])
    with pytest.raises(ValueError, match=r"block: one of \(64, 32\), got 16"):
        block_linear_weight(weight, 16)
    with pytest.raises(ValueError, match="weight: a plain bfloat16"):
        block_linear_weight(weight.float(), 32)
    with pytest.raises(ValueError, match=r"weight: \[out, in\] with out a multiple of 64"):
        block_linear_weight(weight[:32], 64)
    with pytest.raises(ValueError, match="in even"):
        block_linear_weight(weight[:, :3], 32)


@needs_kernel
def test_blocked_linear_names_the_bad_argument():
    weight = block_linear_weight(torch.ones(64, 8, dtype=torch.bfloat16), 64)
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    for bad in (weight.float(), weight[..., :1], weight.reshape(64, 8)):
        with pytest.raises(ValueError, match="weight: "):
            cpu_ops.blocked_linear(x, bad)
    for bad in (x.float(), x[:, :6]):
        with pytest.raises(ValueError, match="x: "):
            cpu_ops.blocked_linear(bad, weight)
    for bad in (torch.ones(32, dtype=torch.bfloat16), torch.ones(64)):
        with pytest.raises(ValueError, match="bias: "):
            cpu_ops.blocked_linear(x, weight, bad)
