// Segmented LoRA for small batches (decoding): each row reads its adapter slot's A and B and runs
// the two low-rank products, rows spread over threads. The torch path's one matmul per adapter
// present costs several short operations per adapter, which for a few rows each (many adapters
// in a decode step) cost more than their arithmetic. Float32, float16 or bfloat16 rows with a
// contiguous last dim, summed in float32 and rounded once where the torch path rounds (h, the
// delta, the sum); slot -1: no adapter.
//
// B comes in either layout of ``[slots, out, rank]``: contiguous (each output's rank values
// side by side, a short dot product per output), or the transpose of a contiguous ``[slots,
// rank, out]`` (each rank's outputs side by side), which the expand reads as ``rank`` long
// vectorized multiply-adds into the row: about three times faster at rank 16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "bf16_dot.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using ember_vec::VW;
using ember_vec::vf;

constexpr int64_t GRAIN_MACS = 1 << 15;  // multiply-adds per thread below which one thread runs

int64_t grain_rows(int64_t macs_per_row) {
  return std::max<int64_t>(1, GRAIN_MACS / std::max<int64_t>(1, macs_per_row));
}

template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  vf acc0{}, acc1{};
  int64_t i = 0;
  for (; i + 2 * VW <= n; i += 2 * VW) {
    acc0 += ember_vec::load_as_float(a + i) * ember_vec::load_as_float(b + i);
    acc1 += ember_vec::load_as_float(a + i + VW) * ember_vec::load_as_float(b + i + VW);
  }
  for (; i + VW <= n; i += VW) {
    acc0 += ember_vec::load_as_float(a + i) * ember_vec::load_as_float(b + i);
  }
  float acc = ember_vec::hsum(acc0 + acc1);
  for (; i < n; ++i) acc += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return acc;
}

#if defined(__AVX512BF16__)
// bfloat16 rows by AVX512-BF16 dot products (pairs of bfloat16 products summed into float32
// lanes), twice the multiply-adds per instruction of widening to float32 first; the tail as the
// other dtypes.
inline float dot(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, ember_bf16::load_bf16x32(a + i),
                            ember_bf16::load_bf16x32(b + i));
    acc1 = _mm512_dpbf16_ps(acc1, ember_bf16::load_bf16x32(a + i + 32),
                            ember_bf16::load_bf16x32(b + i + 32));
  }
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_dpbf16_ps(acc0, ember_bf16::load_bf16x32(a + i),
                            ember_bf16::load_bf16x32(b + i));
  }
  const float head = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  return i == n ? head : head + dot<c10::BFloat16>(a + i, b + i, n - i);
}
#endif

template <typename T>
float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void shrink_impl(const at::Tensor& x, const at::Tensor& lora_a, const int64_t* sp, float s,
                 at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), rank = lora_a.size(1);
  const T* xp = x.data_ptr<T>();
  const T* ap = lora_a.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, rows, grain_rows(rank * k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* o = op + t * out_stride;
      const int64_t slot = sp[t];
      if (slot < 0) {
        std::fill(o, o + rank, static_cast<T>(0.f));
        continue;
      }
      const T* a = ap + slot * rank * k;
      const T* xr = xp + t * x_stride;
      for (int64_t r = 0; r < rank; ++r) o[r] = static_cast<T>(s * dot(a + r * k, xr, k));
    }
  });
}

// y[j] = y[j] + delta[j], with delta rounded to T first (the torch path adds a T product).
template <typename T>
void add_delta(T* y, const float* delta, int64_t n) {
  int64_t j = 0;
  for (; j + VW <= n; j += VW) {
    const vf d = ember_vec::round_as<T>(ember_vec::load(delta + j));
    ember_vec::store_as(y + j, ember_vec::load_as_float(y + j) + d);
  }
  for (; j < n; ++j) y[j] = static_cast<T>(static_cast<float>(y[j]) + rounded<T>(delta[j]));
}

template <typename T>
void expand_impl(at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b, const int64_t* sp,
                 int64_t y_offset, int64_t h_offset) {
  const int64_t rows = y.size(0), n = lora_b.size(1), rank = lora_b.size(2);
  const bool rank_major = lora_b.stride(1) == 1 && rank > 1;  // the transposed layout
  T* yp = y.data_ptr<T>();
  const T* hp = h.data_ptr<T>();
  const T* bp = lora_b.data_ptr<T>();
  const int64_t y_stride = y.stride(0), h_stride = h.stride(0), slot_stride = lora_b.stride(0);
  const int64_t r_stride = rank_major ? lora_b.stride(2) : 1;
  at::parallel_for(0, rows, grain_rows(rank * n), [&](int64_t begin, int64_t end) {
    std::vector<float> delta(n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const T* b = bp + slot * slot_stride;
      const T* hr = hp + t * h_stride + h_offset;
      if (rank_major) {
        std::fill(delta.begin(), delta.end(), 0.f);
        for (int64_t r = 0; r < rank; ++r) {
          const float hv = static_cast<float>(hr[r]);
          if (hv == 0.f) continue;  // zero padding of a smaller rank
          const T* br = b + r * r_stride;
          const vf hvv = ember_vec::splat(hv);
          int64_t j = 0;
          for (; j + VW <= n; j += VW) {
            ember_vec::store(delta.data() + j, ember_vec::load(delta.data() + j) +
                                                   hvv * ember_vec::load_as_float(br + j));
          }
          for (; j < n; ++j) delta[j] += hv * static_cast<float>(br[j]);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) delta[j] = dot(b + j * rank, hr, rank);
      }
      add_delta(yp + t * y_stride + y_offset, delta.data(), n);
    }
  });
}

template <typename F>
void dispatch(const at::Tensor& x, const char* name, const F& f) {
  switch (x.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK_VALUE(false, name, ": unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

void lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& slots,
                 double scale, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == lora_a.scalar_type() && out.scalar_type() == x.scalar_type(),
              "lora_shrink: x, lora_a and out must share a dtype");
  TORCH_CHECK(lora_a.is_contiguous() && x.stride(1) == 1 && out.stride(1) == 1 &&
                  slots.scalar_type() == at::kLong,
              "lora_shrink: contiguous lora_a, rows of x and out, int64 slots expected");
  const int64_t* sp = slots.data_ptr<int64_t>();
  dispatch(x, "lora_shrink", [&](auto t) {
    shrink_impl<decltype(t)>(x, lora_a, sp, static_cast<float>(scale), out);
  });
}

void lora_expand(at::Tensor& y, const at::Tensor& h, const at::Tensor& lora_b,
                 const at::Tensor& slots, int64_t y_offset, int64_t h_offset) {
  TORCH_CHECK(y.scalar_type() == h.scalar_type() && lora_b.scalar_type() == y.scalar_type(),
              "lora_expand: y, h and lora_b must share a dtype");
  const bool contiguous = lora_b.is_contiguous();
  const bool rank_major = lora_b.stride(1) == 1 && lora_b.stride(2) >= lora_b.size(1) &&
                          lora_b.stride(0) >= lora_b.size(2) * lora_b.stride(2);
  TORCH_CHECK((contiguous || rank_major) && y.stride(1) == 1 && h.stride(1) == 1 &&
                  slots.scalar_type() == at::kLong,
              "lora_expand: lora_b contiguous or a transposed contiguous [slots, rank, out], rows "
              "of y and h contiguous, int64 slots expected");
  const int64_t* sp = slots.data_ptr<int64_t>();
  dispatch(y, "lora_expand", [&](auto t) {
    expand_impl<decltype(t)>(y, h, lora_b, sp, y_offset, h_offset);
  });
}

LoRARows lora_rows(const at::Tensor& slots, bool grouped) {
  LoRARows rows;
  if (!slots.defined()) return rows;
  rows.slots = slots.to(at::kLong).contiguous();
  rows.grouped = grouped;
  if (!grouped) return rows;
  // The groups of ember_kernels.lora.LoRAMapping: rows of each slot present, ascending.
  const int64_t tokens = rows.slots.size(0);
  const int64_t* sp = rows.slots.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> members;
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;
    if (static_cast<int64_t>(members.size()) <= sp[t]) members.resize(sp[t] + 1);
    members[sp[t]].push_back(t);
  }
  for (size_t slot = 0; slot < members.size(); ++slot) {
    const auto& m = members[slot];
    if (m.empty()) continue;
    const bool every_row = static_cast<int64_t>(m.size()) == tokens;
    rows.groups.emplace_back(slot, every_row ? at::Tensor() : at::tensor(m, at::kLong));
  }
  return rows;
}

void lora_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& lora_a,
              const std::vector<at::Tensor>& lora_b, const LoRARows& rows) {
  if (!lora_a.defined() || !rows.slots.defined()) return;
  const int64_t rank = lora_b.front().size(2);
  at::Tensor h = at::empty({x.size(0), lora_a.size(1)}, x.options());
  if (!rows.grouped) {
    lora_shrink(x, lora_a, rows.slots, 1.0, h);
    int64_t offset = 0;
    for (size_t i = 0; i < lora_b.size(); ++i) {
      lora_expand(y, h, lora_b[i], rows.slots, offset, static_cast<int64_t>(i) * rank);
      offset += lora_b[i].size(1);
    }
    return;
  }
  // The same operations as ember_kernels.torch_ops.lora, so that both paths agree bit for bit.
  if (!(rows.groups.size() == 1 && !rows.groups[0].second.defined())) h.zero_();
  for (const auto& [slot, members] : rows.groups) {
    const at::Tensor a = lora_a[slot].t();
    if (!members.defined()) {
      at::matmul_out(h, x, a);
    } else {
      h.index_copy_(0, members, at::matmul(x.index_select(0, members), a));
    }
  }
  int64_t offset = 0;
  for (size_t i = 0; i < lora_b.size(); ++i) {
    const int64_t n = lora_b[i].size(1);
    at::Tensor target = y.narrow(1, offset, n);
    const at::Tensor hs = h.narrow(1, static_cast<int64_t>(i) * rank, rank);
    for (const auto& [slot, members] : rows.groups) {
      const at::Tensor b = lora_b[i][slot].t();
      if (!members.defined()) {
        target.add_(at::matmul(hs, b));
      } else {
        target.index_add_(0, members, at::matmul(hs.index_select(0, members), b));
      }
    }
    offset += n;
  }
}
