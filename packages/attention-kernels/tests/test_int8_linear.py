"""Weight-only int8: per-channel and group-wise quantization and the int8-weight matmul (compiled
kernel and the dequantizing float path) against a float64 reference of the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from ember_kernels import cpu_ops
from ember_kernels.int8_linear import (
    INT8_MAX,
    dequantize_int8,
    int8_linear,
    quantize_int8,
    weight_group_size,
)
from ember_kernels.packed_linear import linear


def test_quantize_round_trip_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]
    weight[5] = 0.0
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scales.shape == (64,)
    assert q.abs().max() <= INT8_MAX
    assert scales[5] == 1.0 and not q[5].any()
    # each row's largest magnitude maps to +-127; every element within half a step
    assert torch.equal(q.abs().amax(1)[weight.abs().amax(1) > 0], torch.full((63,), INT8_MAX))
    error = (dequantize_int8(q, scales, torch.float32) - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7 * weight.abs()).all()


def test_group_wise_round_trip_within_half_a_step_of_each_group():
    torch.manual_seed(5)
    weight = torch.randn(24, 192) * torch.logspace(-2, 1, 192)  # ranges that differ per group
    weight[3, 64:128] = 0.0
    q, scales = quantize_int8(weight, 64)
    assert q.shape == weight.shape and scales.shape == (24, 3) and scales.dtype == torch.float32
    assert scales[3, 1] == 1.0 and not q[3, 64:128].any()
    groups = weight.view(24, 3, 64).abs().amax(2)
    assert torch.equal(q.view(24, 3, 64).abs().amax(2)[groups > 0], torch.full((71,), INT8_MAX))
    error = (dequantize_int8(q, scales, torch.float32) - weight).view(24, 3, 64).abs()
    assert (error <= scales[:, :, None] / 2 + 1e-7 * weight.abs().view(24, 3, 64)).all()
    # a column-major weight (as the loader's transposed parameters) quantizes the same
    column_major = quantize_int8(weight.t().contiguous().t(), 64)
    assert torch.equal(column_major[0], q) and torch.equal(column_major[1], scales)
    # finer scales follow each group's range: smaller errors than one scale per channel
    per_channel = dequantize_int8(*quantize_int8(weight), torch.float32) - weight
    assert error.square().sum() < per_channel.square().sum() / 2


def test_group_size_must_divide_the_inputs():
    for group_size in (48, 0, -40):
        with pytest.raises(ValueError, match="group_size"):
            quantize_int8(torch.randn(8, 200), group_size)
    assert (weight_group_size(896), weight_group_size(4864)) == (128, 128)
    assert (weight_group_size(192), weight_group_size(64), weight_group_size(200)) == (64, 64, 200)


def test_quantize_refuses_non_float_or_non_matrix():
    with pytest.raises(ValueError, match="weight"):
        quantize_int8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight"):
        quantize_int8(torch.ones(4))


WIDENED_MAX_ROWS = 4  # int8_gemv.h INT8_GEMV_MAX_ROWS (int8_linear.cpp follows it)


def _reference(x, q, scales, bias):
    groups = 1 if scales.dim() == 1 else scales.shape[1]
    weight = q.double().view(q.shape[0], groups, -1) * scales.double().view(q.shape[0], groups, 1)
    out = x.double() @ weight.view(q.shape).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# up to 4 rows the compiled kernel widens weights in registers; above, it dequantizes blocks
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 16, 21])
@pytest.mark.parametrize("bias", [False, True])
# (in_features, group_size): per channel with a tail past the vector width; groups of 40, each
# with a tail; groups narrower than a vector (all tail); the unrolled 64 and 128 over an odd
# number of groups
@pytest.mark.parametrize("layout", [(200, None), (200, 40), (96, 12), (192, 64), (384, 128)])
def test_int8_linear_matches_float64_reference(dtype, rows, bias, layout):
    torch.manual_seed(rows)
    (in_features, group_size), out_features = layout, 37
    q, scales = quantize_int8(torch.randn(out_features, in_features), group_size)
    x = torch.randn(rows, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    out = int8_linear(x, q, scales, b)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    expected = _reference(x, q, scales, b)
    if rows > WIDENED_MAX_ROWS and cpu_ops.available():
        # the compiled kernel's matmul of x's dtype, on the weight rounded to that dtype (the
        # torch path sums every step in float32)
        expected = _reference(x, dequantize_int8(q, scales, dtype), torch.ones(out_features), b)
    # float32 sums, then one rounding to the activation dtype (bfloat16: 2^-9 relative)
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2**-8, 1e-3)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)


def test_int8_linear_takes_leading_dims_and_strided_rows():
    torch.manual_seed(1)
    q, scales = quantize_int8(torch.randn(48, 64))
    x = torch.randn(2, 3, 128)[..., ::2]  # last dim strided
    out = int8_linear(x, q, scales)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(
        out.double(),
        _reference(x.reshape(-1, 64), q, scales, None).view(2, 3, 48),
        rtol=1e-5,
        atol=1e-4,
    )


@pytest.mark.skipif(not cpu_ops.available(), reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("group_size", [None, 128])
def test_compiled_kernel_and_float_path_agree(rows, group_size):
    torch.manual_seed(2)
    q, scales = quantize_int8(torch.randn(3000, 512), group_size)
    x = torch.randn(rows, 512)
    compiled = cpu_ops.int8_linear(x, q, scales, None)
    dequantized = x @ dequantize_int8(q, scales, torch.float32).T
    torch.testing.assert_close(compiled, dequantized, rtol=1e-4, atol=1e-4)  # sum order


def test_linear_dispatches_int8_and_needs_scales():
    torch.manual_seed(3)
    q, scales = quantize_int8(torch.randn(16, 32))
    x = torch.randn(2, 32)
    torch.testing.assert_close(linear(x, q, None, scales), int8_linear(x, q, scales))
    with pytest.raises(ValueError, match="scales"):
        linear(x, q)
    with pytest.raises(ValueError, match="q/scales"):
        int8_linear(x, q, scales.double())


def test_int8_linear_refuses_scales_of_another_layout():
    q, scales = quantize_int8(torch.randn(16, 96), 32)  # [16, 3]
    x = torch.randn(2, 96)
    five_groups = scales.repeat(1, 2)[:, :5]  # 5 does not divide 96
    for bad in (five_groups, scales[:8], scales.reshape(-1), scales[None]):
        with pytest.raises(ValueError, match="q/scales"):
            int8_linear(x, q, bad.contiguous())
    if cpu_ops.available():  # the compiled kernel's own check, which the decoder stack calls
        with pytest.raises(ValueError, match="scales"):
            cpu_ops.int8_linear(x, q, five_groups.contiguous(), None)


@pytest.mark.skipif(not cpu_ops.available(), reason="compiled CPU kernels unavailable")
def test_batched_int8_linear_runs_its_blocks_in_the_callers_inference_mode():
    """Above WIDENED_MAX_ROWS the blocks run in torch's intra-op threads, which must write the
    caller's inference tensors as the caller could (an engine step runs in inference mode)."""
    torch.manual_seed(4)
    q, scales = quantize_int8(torch.randn(300, 96))  # several blocks, a short last one
    x = torch.randn(12, 96, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            out = int8_linear(x, q, scales)
    finally:
        torch.set_num_threads(threads)
    expected = _reference(x, dequantize_int8(q, scales, torch.bfloat16), torch.ones(300), None)
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3)


@pytest.mark.skipif(not cpu_ops.available(), reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
# (out, in, group): groups of 32, 64, 128 and one per channel up to 4,096 inputs (the decode
# step's integer dot products), a channel of 4,160 (past their largest group: widened to float);
# a ragged number of output channels split between two threads
@pytest.mark.parametrize(
    "shape", [(37, 96, 32), (131, 192, 64), (1, 896, 128), (64, 4096, None), (9, 4160, None)]
)
def test_decode_step_is_the_float_kernel_within_its_activation_steps(dtype, rows, shape):
    """A bfloat16/float16 step of up to 4 rows quantizes its activations to int16 per weight
    group (int8_gemv.cpp): each activation moves by at most half a step, its group's largest
    magnitude / 32767, so the result is the float32-activation kernel's within those moves
    times the weights, and one rounding to ``dtype``; an outlier sets its group's step."""
    torch.manual_seed(rows)
    out_features, in_features, group_size = shape
    q, scales = quantize_int8(torch.randn(out_features, in_features), group_size)
    x = torch.randn(rows, in_features).to(dtype)
    x[0, 3] = 60.0
    bias = torch.randn(out_features).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = cpu_ops.int8_linear(x, q, scales, bias)
    finally:
        torch.set_num_threads(threads)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    exact = cpu_ops.int8_linear(x.float(), q, scales, bias.float()).double()  # floats, summed
    group = group_size or in_features
    amax = x.double().abs().view(rows, -1, group).amax(2, keepdim=True)
    half_steps = (amax / 32767 / 2).expand(rows, in_features // group, group).reshape(rows, -1)
    moved = half_steps @ dequantize_int8(q, scales, torch.float64).abs().T
    bound = moved * 1.001 + exact.abs() * torch.finfo(dtype).eps + 1e-5
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.skipif(not cpu_ops.available(), reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("rows", [5, 8, 13, 32, 40])
# (out, in, group): multiples of 64 channels and not, groups of 32, 128 and one per channel (the
# 0.5B model's down projection's inputs)
@pytest.mark.parametrize(
    "shape", [(128, 896, 128), (200, 256, 32), (37, 4864, None), (320, 4864, 128)]
)
def test_batched_bfloat16_steps_on_whole_and_partial_blocks_of_strided_rows(rows, shape):
    """bfloat16 steps above the decode's rows give the matmul of bfloat16 on the weight rounded
    to bfloat16, with a bias, on rows read from a wider tensor, for any number of channels."""
    torch.manual_seed(rows)
    out_features, in_features, group_size = shape
    q, scales = quantize_int8(torch.randn(out_features, in_features), group_size)
    x = torch.randn(rows, in_features + 64).bfloat16()[:, 32 : 32 + in_features]
    b = torch.randn(out_features).bfloat16()
    out = int8_linear(x, q, scales, b)
    expected = _reference(
        x, dequantize_int8(q, scales, torch.bfloat16), torch.ones(out_features), b
    )
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3)
