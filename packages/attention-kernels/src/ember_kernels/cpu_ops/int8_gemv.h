// The int8 weight-only matmul of a decode step in integer dot products (int8_gemv.cpp), which
// int8_linear runs where it applies.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

// Rows up to which a step counts as decoding: read-bound, every weight read once per step.
constexpr int64_t INT8_GEMV_MAX_ROWS = 4;

// Whether int8_gemv runs x [M, K] against weight int8 [N, K] with scales [N] or [N, G]:
// bfloat16 or float16 rows, at most INT8_GEMV_MAX_ROWS of them, a group size that is a multiple
// of 32 and at most 4,096, a CPU with AVX512-BW.
bool int8_gemv_applies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales);

// out [M, N] = x (weight * scales)^T + bias, in x's dtype; bias (undefined: none) in x's dtype.
void int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
               const at::Tensor& bias, at::Tensor& out);
