"""Weight-only int8: per-channel quantization and the int8-weight matmul (compiled kernel and
the dequantizing float path) against a float64 reference of the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from ember_kernels import cpu_ops
from ember_kernels.int8_linear import INT8_MAX, dequantize_int8, int8_linear, quantize_int8
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


def test_quantize_refuses_non_float_or_non_matrix():
    with pytest.raises(ValueError, match="weight"):
        quantize_int8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight"):
        quantize_int8(torch.ones(4))


WIDENED_MAX_ROWS = 4  # int8_linear.cpp's MAX_WIDENED_ROWS


def _reference(x, q, scales, bias):
    out = x.double() @ (q.double() * scales.double()[:, None]).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# up to 4 rows the compiled kernel widens weights in registers; above, it dequantizes blocks
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 16, 21])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_float64_reference(dtype, rows, bias):
    torch.manual_seed(rows)
    in_features, out_features = 200, 72  # K not a multiple of the vector width: the tail runs
    q, scales = quantize_int8(torch.randn(out_features, in_features))
    x = torch.randn(rows, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    out = int8_linear(x, q, scales, b)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    expected = _reference(x, q, scales, b)
    if rows > WIDENED_MAX_ROWS:  # the matmul of x's dtype, on the weight rounded to that dtype
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
def test_compiled_kernel_and_float_path_agree(rows):
    torch.manual_seed(2)
    q, scales = quantize_int8(torch.randn(3000, 512))
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
