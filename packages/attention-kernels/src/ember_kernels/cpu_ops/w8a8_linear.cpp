// W8A8 int8 matmul (ember_kernels.w8a8_linear): each row of x quantized to int8 with one
// symmetric scale, the int8 x int8 products summed in int32 by at::_int_mm (oneDNN's u8s8
// kernels: AMX-INT8 or AVX512-VNNI where the CPU has them), then scaled by the row's and the
// output channel's scales in float32. The same ATen operations in the same order as the torch
// path, so both give the same bits.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/round.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include "kernels.h"

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scales, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
                    "w8a8_linear: expected x [M, K] and weight [N, K]");
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kChar && weight_scales.scalar_type() == at::kFloat,
                    "w8a8_linear: expected an int8 weight and float32 scales");
  constexpr int64_t kInt8Max = 127;
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor amax = x32.abs().amax({1});
  const at::Tensor x_scales = at::where(amax > 0, amax / kInt8Max, at::ones_like(amax));
  const at::Tensor q =
      at::round(x32 / x_scales.unsqueeze(1)).clamp_(-kInt8Max, kInt8Max).to(at::kChar);
  at::Tensor out = at::_int_mm(q, weight.t()).to(at::kFloat) * x_scales.unsqueeze(1) *
                   weight_scales.unsqueeze(0);
  if (bias.has_value() && bias->defined()) {
    out += bias->to(at::kFloat);
  }
  return out.to(x.scalar_type());
}
