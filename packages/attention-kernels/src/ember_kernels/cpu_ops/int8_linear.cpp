// Weight-only int8 matmul: y = x (q * scales)^T + bias for int8 weights q [N, K] with float32
// scales [N, G], one per K / G consecutive inputs of an output channel (G = 1, scales [N]: one per
// channel), activations float32/bfloat16/float16, summed in float32 (each group's partial sum
// times its scale) and rounded once to the activation dtype. Steps of up to MAX_WIDENED_ROWS rows
// (decoding) read each weight row once: bfloat16/float16 ones in integer dot products
// (int8_gemv.cpp, where it applies), the rest here, widening the weight to float in registers and
// multiplying it into up to ROWS activation rows at a time: half the bytes of a bfloat16 weight.
// Larger steps are bound by arithmetic, not bytes: they run the matmul of the activation dtype
// (oneDNN's bfloat16 dot products for bfloat16, rather than a float32 matmul on converted
// operands) over blocks of the weight dequantized into a scratch
// buffer small enough to stay in cache between the two (writing the whole weight out and reading
// it back would cost more memory traffic than the matmul itself). No dequantized copy is kept:
// the int8 weight's point is its memory.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "int8_gemv.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace ember_vec;

typedef int8_t vi8 __attribute__((vector_size(VW)));

constexpr int ROWS = 4;                    // activation rows sharing one pass over a weight row
constexpr int64_t MAX_WIDENED_ROWS = INT8_GEMV_MAX_ROWS;  // above: the matmul on blocks
constexpr int64_t BLOCK_BYTES = 1 << 20;   // dequantized weight bytes per block (cache-sized)
constexpr int64_t BLOCK_ALIGN = 64;        // output channels per block: a multiple of this
constexpr int64_t GRAIN_BYTES = 1 << 16;   // weight bytes per thread below which one thread runs

// Sign-extend and convert in two instructions (GCC lowers __builtin_convertvector from int8 to a
// lane-by-lane scalar sequence, which ran at about 1 GB/s).
inline vf load_int8_as_float(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  vi8 v;
  std::memcpy(&v, p, sizeof(vi8));
  return __builtin_convertvector(v, vf);
#endif
}

// sums[j] = x[j] . (w * scales) over K, for the first ``rows`` of ROWS activation rows (float32
// copies), each group of ``group`` inputs summed alone and then times its scale (one vector
// multiply-add per group and row, where scaling each widened weight would cost one per vector).
// GROUP: the group size known at compile time (the loops over a group unroll), or 0: ``group``.
template <int R, int64_t GROUP>
void dot_rows(const float* x, int64_t K, const int8_t* w, const float* scales, int64_t dynamic,
              float* sums) {
  const int64_t group = GROUP ? GROUP : dynamic;
  vf total[R];
  float tail_total[R];
  for (int j = 0; j < R; ++j) total[j] = splat(0.f), tail_total[j] = 0.f;
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    const int64_t g1 = g0 + group;
    vf acc0[R], acc1[R];
    for (int j = 0; j < R; ++j) acc0[j] = acc1[j] = splat(0.f);
    int64_t k = g0;
    // Two accumulators per row hide the latency of the fused multiply-adds at one row.
    for (; k + 2 * VW <= g1; k += 2 * VW) {
      const vf w0 = load_int8_as_float(w + k), w1 = load_int8_as_float(w + k + VW);
      for (int j = 0; j < R; ++j) {
        acc0[j] += w0 * load(x + j * K + k);
        acc1[j] += w1 * load(x + j * K + k + VW);
      }
    }
    for (; k + VW <= g1; k += VW) {
      const vf w0 = load_int8_as_float(w + k);
      for (int j = 0; j < R; ++j) acc0[j] += w0 * load(x + j * K + k);
    }
    const vf scale = splat(scales[g]);
    for (int j = 0; j < R; ++j) total[j] += (acc0[j] + acc1[j]) * scale;
    if (k < g1) {  // a group (or a row, per channel) not a multiple of the vector width
      for (int j = 0; j < R; ++j) {
        float sum = 0.f;
        for (int64_t t = k; t < g1; ++t) sum += x[j * K + t] * static_cast<float>(w[t]);
        tail_total[j] += sum * scales[g];
      }
    }
  }
  for (int j = 0; j < R; ++j) sums[j] = hsum(total[j]) + tail_total[j];
}

template <int64_t GROUP>
void dot_block(const float* x, int rows, int64_t K, const int8_t* w, const float* scales,
               int64_t group, float* sums) {
  switch (rows) {
    case 1: return dot_rows<1, GROUP>(x, K, w, scales, group, sums);
    case 2: return dot_rows<2, GROUP>(x, K, w, scales, group, sums);
    case 3: return dot_rows<3, GROUP>(x, K, w, scales, group, sums);
    default: return dot_rows<4, GROUP>(x, K, w, scales, group, sums);
  }
}

// The group sizes ``ember_kernels.int8_linear.GROUP_SIZES`` picks, unrolled; any other at run time.
void dot_block(const float* x, int rows, int64_t K, const int8_t* w, const float* scales,
               int64_t group, float* sums) {
  switch (group) {
    case 128: return dot_block<128>(x, rows, K, w, scales, group, sums);
    case 64: return dot_block<64>(x, rows, K, w, scales, group, sums);
    default: return dot_block<0>(x, rows, K, w, scales, group, sums);
  }
}

template <typename T>
void int8_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const at::Tensor& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const int64_t groups = scales.numel() / N, group = K / groups;
  // The activations as float32 once (a few rows: small), so the inner loop only widens weights.
  std::vector<float> xf(M * K);
  const T* src = static_cast<const T*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = static_cast<float>(src[m * x.stride(0) + k]);
  }
  const int8_t* w = static_cast<const int8_t*>(weight.data_ptr());
  const float* s = static_cast<const float*>(scales.data_ptr());
  const T* b = bias.defined() ? static_cast<const T*>(bias.data_ptr()) : nullptr;
  T* dst = static_cast<T*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, GRAIN_BYTES / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float sums[ROWS];
    for (int64_t n = n0; n < n1; ++n) {
      const float add = b ? static_cast<float>(b[n]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS, M - m0));
        dot_block(xf.data() + m0 * K, rows, K, w + n * K, s + n * groups, group, sums);
        for (int j = 0; j < rows; ++j) dst[(m0 + j) * N + n] = static_cast<T>(sums[j] + add);
      }
    }
  });
}

// w[n - n0] = q[n] * scales[n] (each group of ``group`` inputs times its own scale) in T for the
// rows n in [n0, n1) of an int8 weight [N, K] with ``groups`` scales per row.
template <typename T>
void dequantize_rows(const int8_t* q, const float* scales, int64_t K, int64_t groups,
                     int64_t n0, int64_t n1, T* w) {
  const int64_t group = K / groups;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t g0 = g * group, g1 = g0 + group;
      const int8_t* row = q + n * K;
      T* dst = w + (n - n0) * K;
      const float s = scales[n * groups + g];
      const vf scale = splat(s);
      int64_t k = g0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // one rounding instruction, not five
        for (; k + VW <= g1; k += VW) {
          __m512 v;
          const vf scaled = load_int8_as_float(row + k) * scale;
          std::memcpy(&v, &scaled, sizeof(v));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                              (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
#endif
      for (; k + VW <= g1; k += VW) store_as<T>(dst + k, load_int8_as_float(row + k) * scale);
      for (; k < g1; ++k) dst[k] = static_cast<T>(static_cast<float>(row[k]) * s);
    }
  }
}

// One parallel region: each thread dequantizes a block of output channels into its own scratch
// buffer and runs the (then single-threaded) matmul on it while the block is in its cache; a
// region per block and per step (dequantize, then matmul) cost more in barriers than the work
// when the cores are shared.
template <typename T>
void dequantized_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const at::Tensor& bias, at::Tensor& out) {
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t fit = BLOCK_BYTES / (K * static_cast<int64_t>(sizeof(T)));
  const int64_t per_thread = (N + at::get_num_threads() - 1) / at::get_num_threads();
  const int64_t block = std::max<int64_t>(
      BLOCK_ALIGN, std::min(fit, per_thread + BLOCK_ALIGN - 1) / BLOCK_ALIGN * BLOCK_ALIGN);
  const int64_t num_blocks = (N + block - 1) / block;
  const int8_t* q = static_cast<const int8_t*>(weight.data_ptr());
  const float* s = static_cast<const float*>(scales.data_ptr());
  const at::ThreadLocalState caller;  // inference mode, grad mode: ATen calls in the threads
  at::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    const at::ThreadLocalStateGuard as_caller(caller);
    // Kept per thread: a fresh cache-sized allocation each call is mapped and faulted in page
    // by page, which cost as much as the dequantization.
    thread_local std::vector<char> buffer;
    buffer.resize(std::max<size_t>(buffer.size(), block * K * sizeof(T)));
    T* w = reinterpret_cast<T*>(buffer.data());
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block, size = std::min(block, N - start);
      dequantize_rows<T>(q, s, K, scales.numel() / N, start, start + size, w);
      const at::Tensor part = at::linear(
          x, at::from_blob(w, {size, K}, x.options()),
          bias.defined() ? std::optional<at::Tensor>(bias.narrow(0, start, size)) : std::nullopt);
      out.narrow(1, start, size).copy_(part);
    }
  });
}

}  // namespace

void check_int8_scales(const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kChar && weight.dim() == 2,
                    "int8 weight: expected int8 [N, K], got ", weight.scalar_type(), " ",
                    weight.sizes());
  const bool grouped = scales.dim() == 2 && scales.size(1) > 0 &&
                       weight.size(1) % scales.size(1) == 0;
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.size(0) == weight.size(0) &&
                        (scales.dim() == 1 || grouped),
                    "int8 weight scales: expected float32 [N] or [N, G] with G dividing K for a "
                    "weight ", weight.sizes(), ", got ", scales.scalar_type(), " ", scales.sizes());
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_linear: x must be [rows, K], rows dense");
  TORCH_CHECK(weight.is_contiguous() && scales.is_contiguous(),
              "int8_linear: weight and scales must be contiguous");
  check_int8_scales(weight, scales);
  TORCH_CHECK(weight.size(1) == x.size(1), "int8_linear: x and weight disagree on K");
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (int8_gemv_applies(x, weight, scales)) {
    int8_gemv(x, weight, scales, b, out);
    return out;
  }
  const bool widen = x.size(0) <= MAX_WIDENED_ROWS;
  switch (x.scalar_type()) {
    case at::kFloat:
      widen ? int8_linear_impl<float>(x, weight, scales, b, out)
            : dequantized_linear<float>(x, weight, scales, b, out);
      break;
    case at::kBFloat16:
      widen ? int8_linear_impl<c10::BFloat16>(x, weight, scales, b, out)
            : dequantized_linear<c10::BFloat16>(x, weight, scales, b, out);
      break;
    case at::kHalf:
      widen ? int8_linear_impl<c10::Half>(x, weight, scales, b, out)
            : dequantized_linear<c10::Half>(x, weight, scales, b, out);
      break;
    default: TORCH_CHECK(false, "int8_linear: activations must be float32, bfloat16 or float16");
  }
  return out;
}
