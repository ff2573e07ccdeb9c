// Paged attention's decode inner loops on bfloat16 K/V read in place (see paged_attention.cpp):
// the scores of bfloat16 queries against bfloat16 keys by AVX512-BF16 dot products (pairs of
// bfloat16 products summed into float32 lanes), and the probabilities, rounded to bfloat16,
// dotted with two value rows at a time (bf16_pv). Compiled only where the build target has
// AVX512-BF16 (the build is per CPU: see build.py); ``BF16_DOT`` (and the macro
// ``EMBER_BF16_DOT``) says whether it was.
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


// The PV product in pairs of keys: probabilities rounded to bfloat16 (as a GPU flash kernel
// rounds them for its PV matmul; softmax sums stay float32) and dotted by AVX512-BF16 against
// two value rows interleaved, so each instruction takes two keys' products for sixteen dims.
// unpacklo/hi_epi16 interleave within 128-bit lanes: the sixteen float32 outputs of a 32-dim
// block's low half hold dims [0-3, 8-11, 16-19, 24-27] of it, of its high half the other eight
// of each sixteen. The accumulator ``o`` stays in that order over an item (the softmax only
// scales it); pair_order_to_dims puts it back as it is stored.

// Each row's n float32 probabilities as bfloat16 pairs of consecutive keys, a pair per 32-bit
// unit, an odd key count padded with a zero probability (rows of `pairs_stride` units, n / 2
// rounded up to a multiple of 16 at least).
inline void probability_pairs(const float* s, int64_t M, int64_t s_stride, int64_t n,
                              uint32_t* pairs, int64_t pairs_stride) {
  for (int64_t r = 0; r < M; ++r) {
    const float* sr = s + r * s_stride;
    for (int64_t j = 0; j < n; j += 32) {
      const int64_t lo = std::min<int64_t>(16, n - j);
      const int64_t hi = std::clamp<int64_t>(n - j - 16, 0, 16);
      const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lo) - 1), sr + j);
      const __m512 b = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << hi) - 1), sr + j + 16);
      _mm512_storeu_si512(pairs + r * pairs_stride + j / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// o[r][pair order] += sum over key pairs of (p_r,2k, p_r,2k+1) . (v_2k, v_2k+1) for R rows, one
// 32-dim block of each of the n value rows at `d` (an odd n's last pair repeats its row: its
// second probability is the zero padding).
template <int R>
inline void pv_pairs(const uint32_t* pairs, int64_t pairs_stride,
                     const c10::BFloat16* const* vr, int64_t n, float* o, int64_t D, int64_t d) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm512_loadu_ps(o + r * D + d);
    hi[r] = _mm512_loadu_ps(o + r * D + d + 16);
  }
  for (int64_t j = 0; j < n; j += 2) {
    const __m512i a = _mm512_loadu_si512(vr[j] + d);
    const __m512i b = _mm512_loadu_si512(vr[std::min(j + 1, n - 1)] + d);
    const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b);
    const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int r = 0; r < R; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pairs[r * pairs_stride + j / 2]);
      lo[r] = _mm512_dpbf16_ps(lo[r], pr, vlo);
      hi[r] = _mm512_dpbf16_ps(hi[r], pr, vhi);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(o + r * D + d, lo[r]);
    _mm512_storeu_ps(o + r * D + d + 16, hi[r]);
  }
}

// o [M][D] (pair order) += P . V for n bfloat16 value rows read in place (D a multiple of 32,
// n <= s_stride, an even s_stride), eight rows at a time by each 32-dim block; `pairs` is scratch
// of M * s_stride / 2 units.
inline void bf16_pv(const float* s, int64_t M, int64_t s_stride, const c10::BFloat16* const* vr,
                    int64_t n, float* o, int64_t D, uint32_t* pairs) {
  const int64_t pair_units = s_stride / 2;  // units of a row of pairs
  probability_pairs(s, M, s_stride, n, pairs, pair_units);
  for (int64_t r = 0; r < M; r += 8) {
    const uint32_t* pr = pairs + r * pair_units;
    float* orow = o + r * D;
    for (int64_t d = 0; d < D; d += 32) {
      switch (std::min<int64_t>(8, M - r)) {
#define EMBER_PV_ROWS(R)                              \
  case R:                                             \
    pv_pairs<R>(pr, pair_units, vr, n, orow, D, d);   \
    break;
        EMBER_PV_ROWS(8)
        EMBER_PV_ROWS(7)
        EMBER_PV_ROWS(6)
        EMBER_PV_ROWS(5)
        EMBER_PV_ROWS(4)
        EMBER_PV_ROWS(3)
        EMBER_PV_ROWS(2)
        EMBER_PV_ROWS(1)
#undef EMBER_PV_ROWS
      }
    }
  }
}

// A row of D float32 in pair order (bf16_pv) as dims in order, times `scale`, into `out`.
inline void pair_order_to_dims(const float* o, int64_t D, float scale, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 k = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < D; d += 32) {
    const __m512 lo = _mm512_loadu_ps(o + d), hi = _mm512_loadu_ps(o + d + 16);
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), k));
    _mm512_storeu_ps(out + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), k));
  }
}

}  // namespace ember_bf16
#else
#define EMBER_BF16_DOT 0
namespace ember_bf16 {
constexpr bool BF16_DOT = false;
}  // namespace ember_bf16
#endif
