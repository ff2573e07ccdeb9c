// Segmented LoRA for small batches (decoding): each row reads its adapter slot's A and B and runs
// the two low-rank products as dot products, rows spread over threads. The torch path's one
// matmul per adapter present costs several short operations per adapter, which for a few rows
// each (many adapters in a decode step) cost more than their arithmetic.
// Float32, rows with a contiguous last dim; slot -1: no adapter.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t GRAIN_MACS = 1 << 15;  // multiply-adds per thread below which one thread runs

int64_t grain_rows(int64_t macs_per_row) {
  return std::max<int64_t>(1, GRAIN_MACS / std::max<int64_t>(1, macs_per_row));
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace

void lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& slots,
                 double scale, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && lora_a.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "lora_shrink: float32 tensors expected");
  const int64_t rows = x.size(0), k = x.size(1), rank = lora_a.size(1);
  const float* xp = x.data_ptr<float>();
  const float* ap = lora_a.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const float s = static_cast<float>(scale);
  at::parallel_for(0, rows, grain_rows(rank * k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * out_stride;
      const int64_t slot = sp[t];
      if (slot < 0) {
        std::fill(o, o + rank, 0.f);
        continue;
      }
      const float* a = ap + slot * rank * k;
      const float* xr = xp + t * x_stride;
      for (int64_t r = 0; r < rank; ++r) o[r] = s * dot(a + r * k, xr, k);
    }
  });
}

void lora_expand(at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                 const at::Tensor& slots, int64_t y_offset, int64_t h_offset) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && h.scalar_type() == at::kFloat &&
                  lora_b.scalar_type() == at::kFloat,
              "lora_expand: float32 tensors expected");
  const int64_t rows = y.size(0), n = lora_b.size(1), rank = lora_b.size(2);
  float* yp = y.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const float* bp = lora_b.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t y_stride = y.stride(0), h_stride = h.stride(0);
  at::parallel_for(0, rows, grain_rows(rank * n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const float* b = bp + slot * n * rank;
      const float* hr = hp + t * h_stride + h_offset;
      float* yr = yp + t * y_stride + y_offset;
      for (int64_t j = 0; j < n; ++j) yr[j] += dot(b + j * rank, hr, rank);
    }
  });
}
