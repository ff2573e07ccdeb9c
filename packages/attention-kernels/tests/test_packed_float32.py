"""Ember's streaming kernel on float32 weights packed for oneDNN (AVX-512 multiply-adds, the same
blocked walk as bfloat16's pairs): decode-step rows against a float64 reference, which path runs,
and the float32 row cap, held apart from bfloat16's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ek_inputs import fresh_generator

from ember_kernels import cpu_features, cpu_ops
from ember_kernels.cpu_features import cpu_flags
from ember_kernels.packed_linear import linear, pack_linear_weight

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and cpu_ops.available()),
    reason="needs oneDNN and the compiled CPU kernels",
)

# The Qwen2.5-0.5B projections (fused q/k/v, output, gate/up, down), one block, and a ragged width.
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (64, 64), (320, 96), (160, 96)]


def reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_rows_of_a_decode_step(out_features, in_features, bias):
    """Every row count up to a decode batch and past it (tiles of 6 above 4 rows, a ragged last
    tile, several groups per thread): float32 sums on every path, the kernel where the CPU has
    AVX-512 and oneDNN laid the weight out in blocks the kernel reads, rows of a strided view the
    same as their copy."""
    gen, seed = fresh_generator()
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = pack_linear_weight(weight)
    width = cpu_ops.packed_block_width(packed)
    assert width in (0, 32, 64)
    if "avx512f" not in cpu_flags():
        assert width == 0
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 31, 32, 33):
        x = torch.randn(rows, in_features, generator=gen)
        got = linear(x, packed, b)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        torch.testing.assert_close(
            got.double(), reference(x, weight, b), rtol=1e-5, atol=1e-4, msg=f"seed {seed}"
        )
        runs_kernel = width != 0 and rows <= cpu_ops.packed_gemv_max_rows(torch.float32)
        assert cpu_ops.packed_gemv_applies(x, packed, b) == runs_kernel, f"rows {rows}"
        view = torch.randn(rows, in_features + 3, generator=gen)[:, 3:]
        assert torch.equal(linear(view, packed, b), linear(view.contiguous(), packed, b))


def test_one_row_gives_the_bits_it_gives_beside_others():
    """Each channel's sum runs over the inputs in the same order at every row count, so a row's
    result does not depend on the batch it decodes in."""
    gen, seed = fresh_generator()
    weight = torch.randn(640, 896, generator=gen)
    b = torch.randn(640, generator=gen)
    packed = pack_linear_weight(weight)
    x = torch.randn(32, 896, generator=gen)
    if not cpu_ops.packed_gemv_applies(x, packed, b):
        pytest.skip("no float32 streaming kernel on this CPU")
    batch = cpu_ops.packed_linear(x, packed, b)
    for rows in (1, 2, 5, 13):
        assert torch.equal(cpu_ops.packed_linear(x[:rows], packed, b), batch[:rows]), f"seed {seed}"


def test_a_weight_of_another_dtype_than_x_never_runs_the_kernel():
    """The kernel reads x and the weight as one dtype's units: a float32 x on a bfloat16 weight,
    or the other way round, is left to oneDNN's matmul, never read as the other's bytes."""
    gen, _ = fresh_generator()
    weight = torch.randn(128, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    packed_f32 = pack_linear_weight(weight)
    assert not cpu_ops.packed_gemv_applies(x.bfloat16(), packed_f32)
    assert not cpu_ops.amx_gemm_applies(x.bfloat16(), packed_f32)
    if cpu_features.has_bf16_arithmetic():
        assert not cpu_ops.packed_gemv_applies(x, pack_linear_weight(weight.bfloat16()))


def test_each_dtype_has_its_own_row_cap():
    """The compiled kernels hold the float32 cap apart from bfloat16's (which AMX tiles lower);
    a step above it runs oneDNN's matmul on the same packed weight; other dtypes are refused."""
    assert cpu_ops.packed_gemv_max_rows(torch.float32) == cpu_features.packed_gemv_max_rows(
        torch.float32
    )
    gen, seed = fresh_generator()
    weight = torch.randn(256, 128, generator=gen)
    packed = pack_linear_weight(weight)
    x = torch.randn(5, 128, generator=gen)
    streams = cpu_ops.packed_block_width(packed) != 0
    try:
        cpu_ops.set_packed_gemv_max_rows(0, torch.bfloat16)
        assert cpu_ops.packed_gemv_applies(x, packed) == streams
        cpu_ops.set_packed_gemv_max_rows(4, torch.float32)
        assert cpu_ops.packed_gemv_max_rows(torch.float32) == 4
        assert cpu_ops.packed_gemv_applies(x[:4], packed) == streams
        assert not cpu_ops.packed_gemv_applies(x, packed)
        torch.testing.assert_close(
            cpu_ops.packed_linear(x, packed, None).double(),
            reference(x, weight, None),
            rtol=1e-5,
            atol=1e-4,
            msg=f"seed {seed}",
        )
        with pytest.raises(ValueError, match="dtype: "):
            cpu_ops.set_packed_gemv_max_rows(4, torch.float16)
    finally:
        for dtype in cpu_features.PACKED_GEMV_DTYPES:
            cpu_ops.set_packed_gemv_max_rows(cpu_features.packed_gemv_max_rows(dtype), dtype)
    with pytest.raises(ValueError, match="dtype: "):
        cpu_features.packed_gemv_max_rows(torch.float16)
