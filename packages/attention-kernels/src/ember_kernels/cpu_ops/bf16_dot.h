// AVX512-BF16 dot products for paged attention's decode scores (see paged_attention.cpp): the
// scores of bfloat16 queries against bfloat16 keys read in place, pairs of bfloat16 products
// summed into float32 lanes. Compiled only where the build target has AVX512-BF16 (the build is
// per CPU: see build.py); ``BF16_DOT`` says whether it was.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace ember_bf16 {

constexpr bool BF16_DOT = true;

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(static_cast<const void*>(p));
}

// s[r * s_stride + j] = scale * (q_r . k_j) for M bfloat16 query rows q [M][D] and n keys (D a
// multiple of 32): two rows by four keys at a time, a tail repeating its last row or key; the
// keys ``prefetch_ahead`` further on are asked for meanwhile (pages the prefetcher cannot follow).
inline void bf16_dot_scores(const c10::BFloat16* q, int64_t M, int64_t D,
                            const c10::BFloat16* const* kr, int64_t n, float scale, float* s,
                            int64_t s_stride, int64_t prefetch_ahead) {
  for (int64_t r = 0; r < M; r += 2) {
    const c10::BFloat16* q0 = q + r * D;
    const c10::BFloat16* q1 = q + std::min(r + 1, M - 1) * D;
    for (int64_t j = 0; j < n; j += 4) {
      const c10::BFloat16* k[4];
      for (int i = 0; i < 4; ++i) k[i] = kr[std::min(j + i, n - 1)];
      if (r == 0) {
        for (int i = 0; i < 4; ++i) {
          const auto* ahead =
              reinterpret_cast<const char*>(kr[std::min(j + prefetch_ahead + i, n - 1)]);
          for (int64_t b = 0; b < D * 2; b += 64) __builtin_prefetch(ahead + b, 0, 3);
        }
      }
      __m512 a[2][4];
      for (int i = 0; i < 4; ++i) a[0][i] = a[1][i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh x0 = load_bf16x32(q0 + d), x1 = load_bf16x32(q1 + d);
        for (int i = 0; i < 4; ++i) {
          const __m512bh kd = load_bf16x32(k[i] + d);
          a[0][i] = _mm512_dpbf16_ps(a[0][i], x0, kd);
          a[1][i] = _mm512_dpbf16_ps(a[1][i], x1, kd);
        }
      }
      for (int64_t rr = 0; rr < std::min<int64_t>(2, M - r); ++rr) {
        for (int64_t i = 0; i < std::min<int64_t>(4, n - j); ++i) {
          s[(r + rr) * s_stride + j + i] = _mm512_reduce_add_ps(a[rr][i]) * scale;
        }
      }
    }
  }
}

}  // namespace ember_bf16
#else
namespace ember_bf16 {
constexpr bool BF16_DOT = false;
}  // namespace ember_bf16
#endif
