// The int8 weight-only matmul of a decode step (a few bfloat16 or float16 rows) in integer dot
// products: each activation row is quantized to int16 with one scale per weight group, and each
// weight row, widened from int8 to int16 in one instruction, meets it in 32-pair multiply-adds
// into int32 (AVX512-VNNI's vpdpwssd, else multiply-add and add). Widening every weight to float
// instead cost three instructions per 16 weights and held the kernel at about half the read
// bandwidth bfloat16's matrix-vector kernel reaches (benchmarks/bench_packed_gemv.py); here it is
// two per 32. The weight keeps its plain [N, K] layout: the threads take contiguous runs of output
// channels, so each reads contiguous bytes, in a few long streams (stream_runs).
//
// Exactness: an int16 holds 15 bits of each group's largest magnitude, and a bfloat16 (float16)
// activation has 8 (11) significant bits, so the quantization error is well under the activations'
// own rounding and the output's; float32 activations keep the float path (int8_linear.cpp). The
// int32 sums cannot overflow: a lane adds group / 16 products of at most 32767 * 127.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "int8_gemv.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BW__)

using namespace ember_vec;

constexpr int64_t CHUNK = 32;             // inputs per multiply-add (int16 lanes of a vector)
constexpr int64_t MAX_GROUP = 4096;       // int32 sums stay below 2^31 up to 8,256
constexpr int64_t GRAIN_BYTES = 1 << 16;  // weight bytes per thread below which one thread runs

inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

inline __m512i load_int8_as_int16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline float scale_of(float amax) { return amax > 0.f ? amax / 32767.f : 1.f; }

// xq [M, K] int16 and xs [M, G] float32 for x [M, K] (rows ``x_stride`` apart): each group of
// ``group`` inputs of a row as round(x / s) with s = its largest magnitude / 32767.
template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t M, int64_t K, int64_t group,
                   int16_t* xq, float* xs) {
  const int64_t groups = K / group;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = x + m * x_stride + g * group;
      vf amax = splat(0.f);
      for (int64_t k = 0; k < group; k += VW) {
        const vf v = load_as_float(src + k);
        amax = vmax(amax, v < 0 ? -v : v);
      }
      const float s = scale_of(hmax(amax));
      const vf inv = splat(1.f / s);
      xs[m * groups + g] = s;
      for (int64_t k = 0; k < group; k += VW) {
        const vf v = load_as_float(src + k) * inv;
        __m512 f;
        std::memcpy(&f, &v, sizeof(f));
        const __m256i q = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(f));  // nearest, saturated
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + g * group + k), q);
      }
    }
  }
}

// Output channels ns[0..C) of M rows: each weight row read once, front to back, C rows side by
// side, in A interleaved sums per row and channel to hide the multiply-adds' latency; each
// group's int32 sums scaled into a float total.
template <int M, int A, int C, typename T>
void channels(const int64_t* ns, int64_t N, int64_t K, int64_t group, const int8_t* w,
              const float* w_scales, const int16_t* xq, const float* xs, const T* bias, T* y) {
  const int64_t groups = K / group;
  const int8_t* row[C];
  for (int c = 0; c < C; ++c) row[c] = w + ns[c] * K;
  vf total[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) total[m][c] = splat(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[A][M][C];
    for (int a = 0; a < A; ++a)
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) acc[a][m][c] = _mm512_setzero_si512();
    for (int64_t k = g * group; k < (g + 1) * group; k += A * CHUNK) {
      for (int a = 0; a < A; ++a) {
        __m512i xv[M];
        for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(xq + m * K + k + a * CHUNK);
        for (int c = 0; c < C; ++c) {
          const __m512i wv = load_int8_as_int16(row[c] + k + a * CHUNK);
          for (int m = 0; m < M; ++m) acc[a][m][c] = dot_pairs(acc[a][m][c], wv, xv[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int c = 0; c < C; ++c) {
        __m512i sum = acc[0][m][c];
        for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, acc[a][m][c]);
        const __m512 sums = _mm512_cvtepi32_ps(sum);
        vf f;
        std::memcpy(&f, &sums, sizeof(f));
        total[m][c] += f * splat(w_scales[ns[c] * groups + g] * xs[m * groups + g]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const float add = bias ? static_cast<float>(bias[ns[c]]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + ns[c]] = static_cast<T>(hsum(total[m][c]) + add);
  }
}

// Channels [n0, n1) as C equal runs read side by side, each run one long stream (the prefetchers
// keep several long streams ahead, where adjacent rows read side by side made short streams of one
// row each and ran at half the bandwidth), and the remainder one channel at a time.
template <int M, int A, typename T>
void stream_runs(int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t group, const int8_t* w,
                 const float* s, const int16_t* xq, const float* xs, const T* bias, T* y) {
  constexpr int C = M == 1 ? 4 : 2;  // the sums of more rows fill the registers
  const int64_t run = (n1 - n0) / C;
  int64_t ns[C];
  for (int64_t i = 0; i < run; ++i) {
    for (int c = 0; c < C; ++c) ns[c] = n0 + c * run + i;
    channels<M, A, C>(ns, N, K, group, w, s, xq, xs, bias, y);
  }
  for (int64_t n = n0 + C * run; n < n1; ++n) {
    channels<M, A, 1>(&n, N, K, group, w, s, xq, xs, bias, y);
  }
}

template <int M, typename T>
void channel_range(int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t group,
                   const int8_t* w, const float* s, const int16_t* xq, const float* xs,
                   const T* bias, T* y) {
  // Two sums per row and channel where one row leaves the multiply-adds waiting on each other;
  // at 3-4 rows the rows' own sums are enough, and a second set measured slower (registers).
  if (M < 3 && group % (2 * CHUNK) == 0) {
    stream_runs<M, 2>(n0, n1, N, K, group, w, s, xq, xs, bias, y);
  } else {
    stream_runs<M, 1>(n0, n1, N, K, group, w, s, xq, xs, bias, y);
  }
}

template <typename T>
void gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
          const at::Tensor& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const int64_t group = K / (scales.numel() / N);
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M * (K / group));
  quantize_rows(static_cast<const T*>(x.data_ptr()), x.stride(0), M, K, group, xq.data(),
                xs.data());
  const int8_t* w = static_cast<const int8_t*>(weight.data_ptr());
  const float* s = static_cast<const float*>(scales.data_ptr());
  const T* b = bias.defined() ? static_cast<const T*>(bias.data_ptr()) : nullptr;
  T* y = static_cast<T*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, GRAIN_BYTES / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: return channel_range<1>(n0, n1, N, K, group, w, s, xq.data(), xs.data(), b, y);
      case 2: return channel_range<2>(n0, n1, N, K, group, w, s, xq.data(), xs.data(), b, y);
      case 3: return channel_range<3>(n0, n1, N, K, group, w, s, xq.data(), xs.data(), b, y);
      default: return channel_range<4>(n0, n1, N, K, group, w, s, xq.data(), xs.data(), b, y);
    }
  });
}

#endif  // __AVX512BW__

}  // namespace

bool int8_gemv_applies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
#if defined(__AVX512BW__)
  const int64_t K = weight.size(1), group = K / (scales.numel() / weight.size(0));
  return (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
         x.size(0) <= INT8_GEMV_MAX_ROWS && group % CHUNK == 0 && group <= MAX_GROUP;
#else
  (void)x, (void)weight, (void)scales;
  return false;
#endif
}

void int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
               const at::Tensor& bias, at::Tensor& out) {
#if defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) return gemv<c10::BFloat16>(x, weight, scales, bias, out);
  return gemv<c10::Half>(x, weight, scales, bias, out);
#else
  (void)x, (void)weight, (void)scales, (void)bias, (void)out;
#endif
}
