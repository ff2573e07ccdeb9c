// Paged attention's decode inner loops on bfloat16 K/V read in place (see paged_attention.cpp):
// the scores of bfloat16 queries against bfloat16 keys by AVX512-BF16 dot products (pairs of
// bfloat16 products summed into float32 lanes), and the float32 probabilities times bfloat16
// values converted in registers. Compiled only where the build target has AVX512-BF16 (the build
// is per CPU: see build.py); ``BF16_DOT`` (and the macro ``EMBER_BF16_DOT``) says whether it was.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define EMBER_BF16_DOT 1
#include <immintrin.h>

namespace ember_bf16 {

constexpr bool BF16_DOT = true;

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(static_cast<const void*>(p));
}

// Lanes [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit lane of a and b: half of each sum.
inline __m512 fold_pair(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

// Two fold_pair results summed into [a, b, c, d] per 128-bit lane, a quarter of each sum: the
// 64-bit halves moved as doubles, added as floats.
inline __m512 fold_halves(__m512 ab, __m512 cd) {
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Eight keys' accumulators folded into one vector: 128-bit lane i holds the partial sums of keys
// 0-3 (lanes 0, 1) or 4-7 (lanes 2, 3), two partial sums per key.
inline __m512 fold_eight(const __m512* a) {
  const __m512 ab = fold_pair(a[0], a[1]), cd = fold_pair(a[2], a[3]);
  const __m512 ef = fold_pair(a[4], a[5]), gh = fold_pair(a[6], a[7]);
  const __m512 abcd = fold_halves(ab, cd), efgh = fold_halves(ef, gh);
  return _mm512_add_ps(_mm512_shuffle_f32x4(abcd, efgh, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(abcd, efgh, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Two folded rows (fold_eight) summed out: eight scores of x in the low half, of y in the high.
inline __m512 finish_two(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[r * s_stride + j] = scale * (q_r . k_j) for M bfloat16 query rows q [M][D] and n keys (D a
// multiple of 32): two rows (a last odd row alone) by eight keys at a time, a key tail repeating
// its last key and storing only the real ones. The first row pair's pass also asks for the rows
// ``ahead`` (n_ahead of them, D bfloat16 each), spread evenly over its key groups: rows of pages
// the hardware prefetcher cannot follow, wanted soon after. A score's sixteen float32 lanes are not
// reduced one key at a time (a horizontal sum per score) but eight keys' vectors at once, folded
// into one vector of scores by shuffles and adds (about three operations per score).
inline void bf16_dot_scores(const c10::BFloat16* q, int64_t M, int64_t D,
                            const c10::BFloat16* const* kr, int64_t n, float scale, float* s,
                            int64_t s_stride, const c10::BFloat16* const* ahead,
                            int64_t n_ahead) {
  const int64_t groups = (n + 7) / 8, per_group = (n_ahead + groups - 1) / groups;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < M; r += 2) {
    const bool pair = r + 1 < M;
    const c10::BFloat16* q0 = q + r * D;
    const c10::BFloat16* q1 = q + (pair ? r + 1 : r) * D;
    for (int64_t j = 0; j < n; j += 8) {
      const int64_t nj = std::min<int64_t>(8, n - j);
      const c10::BFloat16* k[8];
      for (int i = 0; i < 8; ++i) k[i] = kr[j + std::min<int64_t>(i, nj - 1)];
      if (r == 0) {
        // Into the L2 cache (locality 2), not L1: a chunk asks for hundreds of lines, and
        // prefetches into L1 stall once its few miss buffers are taken (1.6x on a step's KV
        // out of the caches, A/B).
        const int64_t first = j / 8 * per_group, last = std::min(n_ahead, first + per_group);
        for (int64_t a = first; a < last; ++a) {
          const auto* row = reinterpret_cast<const char*>(ahead[a]);
          for (int64_t b = 0; b < D * 2; b += 64) __builtin_prefetch(row + b, 0, 2);
        }
      }
      __m512 a0[8], a1[8];
      for (int i = 0; i < 8; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
      if (pair) {
        for (int64_t d = 0; d < D; d += 32) {
          const __m512bh x0 = load_bf16x32(q0 + d), x1 = load_bf16x32(q1 + d);
          for (int i = 0; i < 8; ++i) {
            const __m512bh kd = load_bf16x32(k[i] + d);
            a0[i] = _mm512_dpbf16_ps(a0[i], x0, kd);
            a1[i] = _mm512_dpbf16_ps(a1[i], x1, kd);
          }
        }
      } else {
        for (int64_t d = 0; d < D; d += 32) {
          const __m512bh x0 = load_bf16x32(q0 + d);
          for (int i = 0; i < 8; ++i) a0[i] = _mm512_dpbf16_ps(a0[i], x0, load_bf16x32(k[i] + d));
        }
      }
      const __m512 f0 = fold_eight(a0);
      const __m512 both = _mm512_mul_ps(finish_two(f0, pair ? fold_eight(a1) : f0), vscale);
      const __mmask8 keep = static_cast<__mmask8>((1u << nj) - 1);
      _mm256_mask_storeu_ps(s + r * s_stride + j, keep, _mm512_castps512_ps256(both));
      if (pair) {
        _mm256_mask_storeu_ps(s + (r + 1) * s_stride + j, keep,
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(both), 1)));
      }
    }
  }
}


// o[r][:] += sum_j s[r][j] * v_j for R rows and n bfloat16 value rows (D a multiple of 16), each
// value vector converted to float32 in registers: R rows by four vectors of head dims held over
// the keys (a tail block repeats its last vector and stores it once more, unchanged).
template <int R>
inline void pv_rows(const float* s, int64_t s_stride, const c10::BFloat16* const* vr, int64_t n,
                    float* o, int64_t D) {
  for (int64_t d = 0; d < D; d += 64) {
    int64_t off[4];
    for (int i = 0; i < 4; ++i) off[i] = std::min<int64_t>(d + 16 * i, D - 16);
    __m512 a[R][4];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_loadu_ps(o + r * D + off[i]);
    }
    for (int64_t j = 0; j < n; ++j) {
      const c10::BFloat16* v = vr[j];
      __m512 vd[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + off[i]));
        vd[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 pr = _mm512_set1_ps(s[r * s_stride + j]);
        for (int i = 0; i < 4; ++i) a[r][i] = _mm512_fmadd_ps(pr, vd[i], a[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + r * D + off[i], a[r][i]);
    }
  }
}

// o [M][D] += s [M][n] . V for n bfloat16 value rows read in place, four rows at a time (each
// value vector is loaded once per four rows).
inline void bf16_pv(const float* s, int64_t M, int64_t s_stride,
                    const c10::BFloat16* const* vr, int64_t n, float* o, int64_t D) {
  for (int64_t r = 0; r < M; r += 4) {
    const float* sr = s + r * s_stride;
    float* orow = o + r * D;
    switch (std::min<int64_t>(4, M - r)) {
      case 4:
        pv_rows<4>(sr, s_stride, vr, n, orow, D);
        break;
      case 3:
        pv_rows<3>(sr, s_stride, vr, n, orow, D);
        break;
      case 2:
        pv_rows<2>(sr, s_stride, vr, n, orow, D);
        break;
      default:
        pv_rows<1>(sr, s_stride, vr, n, orow, D);
    }
  }
}

}  // namespace ember_bf16
#else
#define EMBER_BF16_DOT 0
namespace ember_bf16 {
constexpr bool BF16_DOT = false;
}  // namespace ember_bf16
#endif
