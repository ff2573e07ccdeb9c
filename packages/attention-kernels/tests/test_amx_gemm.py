"""AMX tiles for the bfloat16 steps of a decode batch on oneDNN's 32-wide packed layout
(``cpu_ops/amx_gemm.cpp``): which steps take them, and their sums against a float64 reference.
The kernel runs only on a CPU with AMX-BF16 (the other tests here skip elsewhere)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ek_inputs import fresh_generator

from ember_kernels import cpu_features, cpu_ops
from ember_kernels.packed_linear import pack_linear_weight


def amx_runs() -> bool:
    """Whether this process runs the tiles: a 32-wide packed weight takes them at 32 rows."""
    if not (cpu_features.has_amx_bf16() and cpu_ops.available()):
        return False
    weight = pack_linear_weight(torch.randn(64, 64).bfloat16())
    return cpu_ops.amx_gemm_applies(torch.randn(32, 64).bfloat16(), weight)


needs_amx = pytest.mark.skipif(
    not amx_runs(), reason="the AMX tiles need a CPU with AMX-BF16 and the compiled kernels"
)

# The Qwen2.5-0.5B projections (fused q/k/v, output, gate/up, down), one block, odd block counts.
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (32, 32), (96, 64), (160, 992)]


def reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def test_the_cap_is_the_decode_batch_where_the_cpu_has_amx(monkeypatch):
    for amx, cap in ((True, cpu_features.AMX_GEMM_MAX_ROWS), (False, 0)):
        monkeypatch.setattr(cpu_features, "has_amx_bf16", lambda amx=amx: amx)
        assert cpu_features.amx_gemm_max_rows.__wrapped__() == cap


@pytest.mark.skipif(not cpu_ops.available(), reason="needs the compiled CPU kernels")
def test_the_kernels_hold_this_cpus_cap():
    assert cpu_ops.amx_gemm_max_rows() == cpu_features.amx_gemm_max_rows()


@needs_amx
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_sum_every_decode_batch_right(out_features, in_features, bias):
    """Every row count between the streaming kernel's cap and 32 runs the tiles (the rows of two
    tiles, one, and part of one), equal to float64 sums within bfloat16's rounding."""
    gen, seed = fresh_generator()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = pack_linear_weight(weight)
    assert cpu_ops.packed_block_width(packed) == 32
    for rows in range(cpu_ops.packed_gemv_max_rows() + 1, 33):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        assert cpu_ops.amx_gemm_applies(x, packed, b), f"rows {rows}"
        got = cpu_ops.packed_linear(x, packed, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        torch.testing.assert_close(
            got.double(), reference(x, weight, b), rtol=1e-2, atol=5e-2,
            msg=f"rows {rows}, seed {seed}",
        )  # fmt: skip


@needs_amx
def test_tiles_read_strided_rows_and_leave_other_steps_to_onednn():
    """Rows of a wider tensor (a view, as a fused projection's output slices are) read in place;
    a step of 33 rows, inputs not a multiple of 32, or a float32 step run oneDNN's matmul."""
    gen, seed = fresh_generator()
    weight = torch.randn(256, 128, generator=gen).bfloat16()
    packed = pack_linear_weight(weight)
    wide = torch.randn(20, 192, generator=gen).bfloat16()
    x = wide[:, 32:160]
    assert x.stride(0) == 192 and cpu_ops.amx_gemm_applies(x, packed)
    torch.testing.assert_close(
        cpu_ops.packed_linear(x, packed, None).double(), reference(x, weight, None),
        rtol=1e-2, atol=5e-2, msg=f"seed {seed}",
    )  # fmt: skip
    assert not cpu_ops.amx_gemm_applies(torch.randn(33, 128).bfloat16(), packed)
    odd = torch.randn(64, 48, generator=gen).bfloat16()
    assert not cpu_ops.amx_gemm_applies(torch.randn(8, 48).bfloat16(), pack_linear_weight(odd))
    assert not cpu_ops.amx_gemm_applies(torch.randn(8, 128), packed)


@needs_amx
def test_a_zero_cap_hands_every_step_to_onednn():
    packed = pack_linear_weight(torch.randn(64, 64).bfloat16())
    x = torch.randn(8, 64).bfloat16()
    try:
        cpu_ops.set_amx_gemm_max_rows(0)
        assert not cpu_ops.amx_gemm_applies(x, packed)
    finally:
        cpu_ops.set_amx_gemm_max_rows(cpu_features.amx_gemm_max_rows())
    assert cpu_ops.amx_gemm_applies(x, packed)
