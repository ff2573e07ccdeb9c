// Greedy sampling's argmax over each row of a step's logits, read once in place: bfloat16 logits
// widened in registers (no float32 copy of a [batch, vocabulary] tensor), rows split between the
// threads. numpy's answer for the same values: the first index of the largest value (-0.0 and
// 0.0 equal), or of the first NaN in a row that has one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "kernels.h"
#include "vec.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The first NaN's index (-1: none).
template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(static_cast<float>(row[i]))) return i;
  }
  return -1;
}

// The scalar scan: the first index of the largest of row[start:n] given the best so far.
template <typename T>
int64_t scan(const T* row, int64_t start, int64_t n, float best, int64_t at) {
  for (int64_t i = start; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return i;
    if (v > best) best = v, at = i;
  }
  return at;
}

#if defined(__AVX512F__)

using ember_vec::load_as_m512;

// Two lanes' bests merged lane by lane: the larger value, on equal values the smaller index.
inline void merge(__m512& best, __m512i& at, __m512 other, __m512i other_at) {
  const __mmask16 take =
      _mm512_cmp_ps_mask(other, best, _CMP_GT_OQ) |
      (_mm512_cmp_ps_mask(other, best, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(other_at, at));
  best = _mm512_mask_mov_ps(best, take, other);
  at = _mm512_mask_mov_epi32(at, take, other_at);
}

// Sixteen lanes of running bests, two vectors of them (32 values a step), each lane keeping the
// first index of its largest value; a NaN anywhere hands the row to the scalar scan.
template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  constexpr int64_t STEP = 32;
  if (n < STEP) return scan(row, 0, n, -std::numeric_limits<float>::infinity(), 0);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best0 = load_as_m512(row), best1 = load_as_m512(row + 16);
  __m512i at0 = lanes, at1 = _mm512_add_epi32(lanes, _mm512_set1_epi32(16));
  __mmask16 nan = _mm512_cmp_ps_mask(best0, best0, _CMP_UNORD_Q) |
                  _mm512_cmp_ps_mask(best1, best1, _CMP_UNORD_Q);
  int64_t i = STEP;
  for (; i + STEP <= n; i += STEP) {
    const __m512 v0 = load_as_m512(row + i), v1 = load_as_m512(row + i + 16);
    const __m512i i0 = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(i)));
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(16));
    const __mmask16 up0 = _mm512_cmp_ps_mask(v0, best0, _CMP_GT_OQ);
    const __mmask16 up1 = _mm512_cmp_ps_mask(v1, best1, _CMP_GT_OQ);
    nan |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
    best0 = _mm512_mask_mov_ps(best0, up0, v0);
    at0 = _mm512_mask_mov_epi32(at0, up0, i0);
    best1 = _mm512_mask_mov_ps(best1, up1, v1);
    at1 = _mm512_mask_mov_epi32(at1, up1, i1);
  }
  if (nan) return first_nan(row, n);
  merge(best0, at0, best1, at1);
  const float top = _mm512_reduce_max_ps(best0);
  const __mmask16 tops = _mm512_cmp_ps_mask(best0, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const int64_t at = _mm512_mask_reduce_min_epi32(tops, at0);
  return scan(row, i, n, top, at);
}

#else

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  return scan(row, 0, n, -std::numeric_limits<float>::infinity(), 0);
}

#endif

template <typename T>
void argmax_impl(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* data = logits.data_ptr<T>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = row_argmax(data + r * stride, n);
  });
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0 &&
                        logits.size(1) <= std::numeric_limits<int32_t>::max(),
                    "logits: [rows, vocab] with contiguous rows and a vocab of 1 to 2^31 - 1");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  switch (logits.scalar_type()) {
    case at::kFloat: argmax_impl<float>(logits, out); break;
    case at::kBFloat16: argmax_impl<c10::BFloat16>(logits, out); break;
    default: TORCH_CHECK_VALUE(false, "logits: float32 or bfloat16, got ", logits.scalar_type());
  }
  return out;
}
