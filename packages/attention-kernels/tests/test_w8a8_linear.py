"""W8A8 int8: per-token activation quantization and the int8 x int8 matmul (torch's ``_int_mm``
on the CPU) against the float64 reference of the same integers, and against the float matmul."""

from __future__ import annotations

import pytest
import torch

from ember_kernels import cpu_ops
from ember_kernels.int8_linear import INT8_MAX, quantize_int8
from ember_kernels.packed_linear import linear
from ember_kernels.w8a8_linear import quantize_per_token, w8a8_linear, w8a8_linear_reference


def test_per_token_quantization_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(9, 40) * torch.logspace(-3, 2, 9)[:, None]
    x[4] = 0.0
    q, scales = quantize_per_token(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.shape == (9,)
    assert scales[4] == 1.0 and not q[4].any()
    nonzero = x.abs().amax(1) > 0
    assert torch.equal(q.abs().amax(1)[nonzero], torch.full((8,), INT8_MAX, dtype=torch.int8))
    error = (q.float() * scales[:, None] - x).abs()
    assert (error <= scales[:, None] / 2 + 1e-6 * x.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_reference_to_the_bit(dtype, rows, with_bias):
    torch.manual_seed(rows)
    weight = torch.randn(72, 200)
    q, scales = quantize_int8(weight)
    x = torch.randn(2, rows, 200).to(dtype)
    bias = torch.randn(72).to(dtype) if with_bias else None
    out = w8a8_linear(x, q, scales, bias)
    assert out.dtype == dtype and out.shape == (2, rows, 72)
    assert torch.equal(out, w8a8_linear_reference(x, q, scales, bias))
    # ... and through the layers' entry point
    assert torch.equal(linear(x, q, bias, scales, quantize_activations=True), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_equals_the_compiled_kernel(dtype, monkeypatch):
    torch.manual_seed(2)
    q, scales = quantize_int8(torch.randn(48, 96))
    x, bias = torch.randn(7, 96).to(dtype), torch.randn(48).to(dtype)
    compiled = w8a8_linear(x, q, scales, bias)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert torch.equal(w8a8_linear(x, q, scales, bias), compiled)


def test_close_to_the_float_matmul():
    torch.manual_seed(1)
    weight, x = torch.randn(128, 256), torch.randn(16, 256)
    q, scales = quantize_int8(weight)
    exact = x.double() @ weight.double().T
    error = (w8a8_linear(x, q, scales).double() - exact).abs().max()
    assert error < 0.02 * exact.abs().max()  # two 8-bit roundings per product


def test_refuses_wrong_dtypes_and_shapes():
    q, scales = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="q_weight/weight_scales"):
        w8a8_linear(torch.randn(2, 16), q.float(), scales)
    with pytest.raises(ValueError, match="q_weight/weight_scales"):
        w8a8_linear(torch.randn(2, 16), q, scales[:4])
