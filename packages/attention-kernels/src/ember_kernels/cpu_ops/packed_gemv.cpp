// y = x W^T (+ b) on a weight packed for oneDNN (ember_kernels.packed_linear), and Ember's own
// path for the rows of a decode step in bfloat16 or float32: a step of one token reads every
// weight once, so it runs at the speed memory streams the weight in. oneDNN's matmul reached
// 0.5-0.8 of a summing loop's read bandwidth at one row, and below its large-batch rate at 8-32
// rows (benchmarks/bench_packed_gemv.py); here each thread streams its equal share of blocks one
// after another (above 4 rows, a thread done early takes groups from the back of another's share:
// group_shares.h), straight from the packed bytes (no second copy), with AVX512-BF16 dot products
// (bfloat16) or AVX-512 multiply-adds (float32) into float32, a block's rows in register tiles
// while its weights are in cache.
//
// The packed layout is oneDNN's choice, blocks of W output channels holding each 32-bit unit of
// input (a pair of bfloat16, or one float32) for its W channels in turn; packed_layout.cpp says
// which W (64 or 32) a weight's bytes are in, if either. The kernels take W as a template
// parameter. Any other layout, CPU or dtype runs oneDNN's matmul.
//
// The most rows the kernel takes per dtype is told at load by ember_kernels.cpu_features (the
// choice's one owner): streaming wins while a step is bound by the weight's bytes, but
// AVX512-BF16 dot products at 32 rows are bound by arithmetic, which AMX tiles do several times
// faster, so on a CPU with AMX the bfloat16 steps above a few rows run AMX tiles on the same
// packed bytes (amx_gemm.cpp), up to a decode batch, and oneDNN's matmul above.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "amx_gemm.h"
#include "group_shares.h"
#include "kernels.h"
#include "packed_layout.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <immintrin.h>

using ember_packed::packed_bytes;
using ember_packed::packed_width;

namespace {

// The most rows of a step the streaming kernel takes, bfloat16 and float32, and of a bfloat16
// one the AMX tiles take above it (0 until told: oneDNN runs every step).
std::atomic<int64_t> max_rows_bf16{0};
std::atomic<int64_t> max_rows_f32{0};
std::atomic<int64_t> amx_max_rows{0};

std::atomic<int64_t>& max_rows(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kFloat,
                    "dtype: the streaming kernel runs bfloat16 or float32 steps, got ", dtype);
  return dtype == at::kBFloat16 ? max_rows_bf16 : max_rows_f32;
}

// How far ahead of each block's stream a one-row step asks for the weight in L2, in bytes of a
// 64-wide block (the same number of input units ahead at either width): the hardware prefetchers
// alone keep too few lines in flight for one core to stream at the memory's speed (the A/B is in
// the package README).
constexpr int64_t PREFETCH_BYTES = 1024;
constexpr int GEMM_ROW_TILE = 6;  // rows per register tile above 4 rows: 24 accumulators

at::Tensor onednn_matmul(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

#if defined(__AVX512F__)

// How a step multiplies: both read x and the weight as 32-bit units, a pair of bfloat16 (dotted
// into float32 by AVX512-BF16) or one float32 (multiply-added).
#if defined(__AVX512BF16__)
struct Bf16Pairs {
  using T = c10::BFloat16;
  static constexpr at::ScalarType DTYPE = at::kBFloat16;
  static constexpr int PER_UNIT = 2;
  static __m512 madd(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
  static void store(T* y, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#endif

struct Fp32 {
  using T = float;
  static constexpr at::ScalarType DTYPE = at::kFloat;
  static constexpr int PER_UNIT = 1;
  static __m512 madd(__m512 acc, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), acc);
  }
  static void store(T* y, __m512 v) { _mm512_storeu_ps(y, v); }
};

// Output channels [block * W, (block + B) * W) of M rows, x and w read as 32-bit units (A): for
// each unit of input, the unit of each row broadcast and multiplied into the next W channels'
// units (W / 16 vectors per block), so the weight streams through once, in its stored order; one
// row also prefetches each block's stream PREFETCH_BYTES * W / 64 ahead, and a tile that reads
// its blocks from cache asks for `prefetch_step` bytes of `prefetch` per unit (past a weight's
// end a prefetch reads nothing, and never faults). Each channel's sum runs over the units in the
// same order at either width.
template <typename A, int W, int M, int B>
void gemv_blocks(const uint32_t* x, int64_t x_stride, const uint32_t* w, int64_t units,
                 const typename A::T* bias, typename A::T* y, int64_t y_stride,
                 const char* prefetch = nullptr, int64_t prefetch_step = 0) {
  constexpr int V = W / 16;
  __m512 acc[M][B][V];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < V; ++i) acc[m][b][i] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    __m512i xs[M];
    for (int m = 0; m < M; ++m) xs[m] = _mm512_set1_epi32(x[m * x_stride + u]);
    for (int64_t off = 0; off < prefetch_step; off += 64) {
      _mm_prefetch(prefetch + u * prefetch_step + off, _MM_HINT_T1);
    }
    for (int b = 0; b < B; ++b) {
      const uint32_t* line = w + (b * units + u) * W;
      if constexpr (M == 1) {
        const char* ahead = reinterpret_cast<const char*>(line) + PREFETCH_BYTES * W / 64;
        for (int i = 0; i < V; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T1);
      }
      for (int i = 0; i < V; ++i) {
        const __m512i wv = _mm512_loadu_si512(line + 16 * i);
        for (int m = 0; m < M; ++m) acc[m][b][i] = A::madd(acc[m][b][i], xs[m], wv);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < V; ++i) {
      const int64_t col = b * W + 16 * i;
      const __m512 add =
          bias != nullptr ? ember_vec::load_as_m512(bias + col) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        A::store(y + m * y_stride + col, _mm512_add_ps(acc[m][b][i], add));
      }
    }
  }
}

// Blocks [begin, end) of M rows, G (a power of two) blocks at a time, then the rest (fewer than
// G) in one pass of each smaller power of two that it holds, so that a share which is not a
// multiple of G (two threads' 14 blocks of 32 each of an 896-channel output: 8 + 6) still reads
// its last blocks as several streams side by side, not one stream at a time.
template <typename A, int W, int M, int G>
void blocks_by(int64_t begin, int64_t end, const uint32_t* x, int64_t x_stride,
               const uint32_t* w, int64_t units, const typename A::T* bias, typename A::T* y,
               int64_t y_stride) {
  static_assert((G & (G - 1)) == 0, "G: a power of two");
  int64_t block = begin;
  for (; block + G <= end; block += G) {
    gemv_blocks<A, W, M, G>(x, x_stride, w + block * W * units, units,
                            bias ? bias + block * W : nullptr, y + block * W, y_stride);
  }
  if constexpr (G > 1) blocks_by<A, W, M, G / 2>(block, end, x, x_stride, w, units, bias, y,
                                                 y_stride);
}

// Blocks [begin, end) of up to 4 rows: 256 channels at a time for one row, 128 for two (more
// streams in flight; the accumulators of more rows fill the registers), 64 above.
template <typename A, int W, int M>
void gemv_range(int64_t begin, int64_t end, const uint32_t* x, int64_t x_stride,
                const uint32_t* w, int64_t units, const typename A::T* bias, typename A::T* y,
                int64_t y_stride) {
  constexpr int G = (M == 1 ? 4 : M == 2 ? 2 : 1) * 64 / W;
  blocks_by<A, W, M, G>(begin, end, x, x_stride, w, units, bias, y, y_stride);
}

// One tile of rows over the blocks [group, group_end) of one group: a whole group in one pass
// (asking for `prefetch`'s bytes on the way), a ragged last group a block at a time.
template <typename A, int W, int M, int G>
void group_tile(int64_t group, int64_t group_end, const uint32_t* x, int64_t x_stride,
                const uint32_t* w, int64_t units, const typename A::T* bias, typename A::T* y,
                int64_t y_stride, const char* prefetch, int64_t prefetch_step) {
  if (group_end - group < G) {
    blocks_by<A, W, M, G>(group, group_end, x, x_stride, w, units, bias, y, y_stride);
    return;
  }
  gemv_blocks<A, W, M, G>(x, x_stride, w + group * W * units, units,
                          bias ? bias + group * W : nullptr, y + group * W, y_stride, prefetch,
                          prefetch_step);
}

// One group of 64 channels (blocks [group, group_end)) for any number of rows, in tiles of at
// most ROW_TILE rows (what the registers hold beside the four weight vectors), so the first tile
// streams the weights in from memory and the others read them again from cache. The whole tiles
// after the first read the group from cache; meanwhile each asks for a quarter of `next` (the
// group the thread takes next, or null) in L2, a line per unit of input, so that at a decode
// batch's rows no tile waits on memory. A ragged tile is already bound by cache reads.
template <typename A, int W, int ROW_TILE>
void gemm_group(int64_t group, int64_t group_end, int64_t rows, const uint32_t* x,
                int64_t x_stride, const uint32_t* w, int64_t units, const typename A::T* bias,
                typename A::T* y, int64_t y_stride, const char* next) {
  constexpr int G = 64 / W;
  constexpr int64_t step = 64;
  const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
  const int64_t group_bytes = int64_t{64} * units * 4;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t row = tile * ROW_TILE;
    const uint32_t* xr = x + row * x_stride;
    typename A::T* yr = y + row * y_stride;
    const int64_t from = (tile - 1) * units * step;
    const bool ahead = next != nullptr && tile > 0 && rows - row >= ROW_TILE && from < group_bytes;
    const char* pf = ahead ? next + from : nullptr;
    const int64_t pf_step = ahead ? step : 0;
    switch (std::min<int64_t>(ROW_TILE, rows - row)) {
#define EMBER_ROW_TILE(R)                                                                       \
  group_tile<A, W, R, G>(group, group_end, xr, x_stride, w, units, bias, yr, y_stride, pf, \
                         pf_step);                                                              \
  break;
      case 1: EMBER_ROW_TILE(1)
      case 2: EMBER_ROW_TILE(2)
      case 3: EMBER_ROW_TILE(3)
      case 4: EMBER_ROW_TILE(4)
      case 5: EMBER_ROW_TILE(5)
      default: EMBER_ROW_TILE(ROW_TILE)
#undef EMBER_ROW_TILE
    }
  }
}

// All blocks of a step above 4 rows, groups of 64 channels shared out as GroupShares says.
template <typename A, int W, int ROW_TILE>
void gemm_shared(int64_t blocks, int64_t rows, const uint32_t* x, int64_t x_stride,
                 const uint32_t* w, int64_t units, const typename A::T* bias, typename A::T* y,
                 int64_t y_stride) {
  constexpr int G = 64 / W;
  const int64_t groups = (blocks + G - 1) / G;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  ember_shares::GroupShares shares(groups, threads);
  const auto run = [&](int64_t group, int64_t after) {
    const int64_t first = group * G, last = std::min<int64_t>(first + G, blocks);
    const char* next =
        after < 0 ? nullptr : reinterpret_cast<const char*>(w + after * G * W * units);
    gemm_group<A, W, ROW_TILE>(first, last, rows, x, x_stride, w, units, bias, y, y_stride, next);
  };
  at::parallel_for(0, shares.threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t group, after;
      while (shares.take_front(t, group, after)) run(group, after);
      for (int64_t k = 1; k < shares.threads(); ++k) {
        const int64_t other = (t + k) % shares.threads();
        while (shares.take_back(other, group)) run(group, -1);
      }
    }
  });
}

// y [M, N] = x [M, K] w^T + bias for w in the blocked layout of width W.
template <typename A, int W>
at::Tensor blocked_gemv(const at::Tensor& x, const uint32_t* w, int64_t N, int64_t K,
                        const typename A::T* b) {
  const int64_t M = x.size(0), units = K / A::PER_UNIT;
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xs = static_cast<const uint32_t*>(x.data_ptr());
  const int64_t x_stride = x.stride(0) / A::PER_UNIT;
  auto* out = static_cast<typename A::T*>(y.data_ptr());
  if (M > 4) {
    gemm_shared<A, W, GEMM_ROW_TILE>(N / W, M, xs, x_stride, w, units, b, out, N);
    return y;
  }
  // Equal shares of blocks, so both threads finish together (the head's 2,374 blocks of 64, a
  // down projection's 14).
  at::parallel_for(0, N / W, 1, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: gemv_range<A, W, 1>(begin, end, xs, x_stride, w, units, b, out, N); break;
      case 2: gemv_range<A, W, 2>(begin, end, xs, x_stride, w, units, b, out, N); break;
      case 3: gemv_range<A, W, 3>(begin, end, xs, x_stride, w, units, b, out, N); break;
      default: gemv_range<A, W, 4>(begin, end, xs, x_stride, w, units, b, out, N); break;
    }
  });
  return y;
}

template <typename A>
at::Tensor blocked_gemv(const at::Tensor& x, const uint32_t* w, int64_t width, int64_t N,
                        int64_t K, const at::Tensor& bias) {
  const auto* b = bias.defined() ? static_cast<const typename A::T*>(bias.data_ptr()) : nullptr;
  return width == 64 ? blocked_gemv<A, 64>(x, w, N, K, b) : blocked_gemv<A, 32>(x, w, N, K, b);
}

// Whether x [M, K] can be read as rows of 32-bit units of A's dtype, and bias fits N outputs.
template <typename A>
bool rows_fit(const at::Tensor& x, int64_t N, int64_t K, const std::optional<at::Tensor>& bias) {
  return x.scalar_type() == A::DTYPE && x.dim() == 2 && x.size(1) == K && x.stride(1) == 1 &&
         x.stride(0) % A::PER_UNIT == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0 &&
         (!bias ||
          (bias->scalar_type() == A::DTYPE && bias->is_contiguous() && bias->numel() == N));
}

#endif  // __AVX512F__

}  // namespace

void set_packed_gemv_max_rows(int64_t rows, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(rows >= 0, "rows: the kernel's largest step must be >= 0, got ", rows);
  max_rows(dtype).store(rows);
}

int64_t packed_gemv_max_rows(at::ScalarType dtype) { return max_rows(dtype).load(); }

bool packed_gemv_applies(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
#if defined(__AVX512F__)
  const at::ScalarType dtype = x.scalar_type();
  if (!weight.is_mkldnn() || x.dim() != 2 || x.size(0) < 1 || weight.dim() != 2 ||
      weight.scalar_type() != dtype || (dtype != at::kBFloat16 && dtype != at::kFloat) ||
      x.size(0) > max_rows(dtype).load()) {
    return false;
  }
  const int64_t N = weight.size(0), K = weight.size(1);
#if defined(__AVX512BF16__)
  if (rows_fit<Bf16Pairs>(x, N, K, bias)) return packed_width(weight) != 0;
#endif
  return rows_fit<Fp32>(x, N, K, bias) && packed_width(weight) != 0;
#else
  (void)x, (void)weight, (void)bias;
  return false;
#endif
}

bool amx_gemm_applies(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  return weight.is_mkldnn() && weight.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
         x.size(0) > max_rows_bf16.load() && x.size(0) <= amx_max_rows.load() &&
         weight.dim() == 2 &&
         weight.size(1) % AMX_GEMM_DEPTH == 0 &&
         rows_fit<Bf16Pairs>(x, weight.size(0), weight.size(1), bias) && amx_tiles_ready() &&
         packed_width(weight) == AMX_GEMM_WIDTH;
#else
  (void)x, (void)weight, (void)bias;
  return false;
#endif
}

void set_amx_gemm_max_rows(int64_t rows) {
  TORCH_CHECK_VALUE(rows >= 0 && rows <= AMX_GEMM_ROWS, "rows: the AMX tiles' largest step must ",
                    "be in [0, ", AMX_GEMM_ROWS, "], got ", rows);
  amx_max_rows.store(rows);
}

int64_t amx_gemm_max_rows() { return amx_max_rows.load(); }

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
#if defined(__AVX512F__)
  if (packed_gemv_applies(x, weight, bias)) {
    const at::Tensor b = bias ? *bias : at::Tensor();
#if defined(__AVX512BF16__)
    if (x.scalar_type() == at::kBFloat16) {
      return blocked_gemv<Bf16Pairs>(x, packed_bytes(weight), packed_width(weight),
                                     weight.size(0), weight.size(1), b);
    }
#endif
    return blocked_gemv<Fp32>(x, packed_bytes(weight), packed_width(weight), weight.size(0),
                              weight.size(1), b);
  }
#endif
#if defined(__AVX512BF16__)
  if (amx_gemm_applies(x, weight, bias)) {
    const int64_t N = weight.size(0);
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    amx_gemm(x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(0),
             reinterpret_cast<const uint16_t*>(packed_bytes(weight)), N,
             weight.size(1), bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
             y.data_ptr<c10::BFloat16>(), N);
    return y;
  }
#endif
  return onednn_matmul(x, weight, bias);
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK_VALUE(weight.dim() == 4 && weight.scalar_type() == at::kBFloat16 &&
                        weight.is_contiguous() && weight.size(3) == 2 &&
                        (weight.size(2) == 64 || weight.size(2) == 32),
                    "weight: a contiguous bfloat16 [out / W, in / 2, W, 2] tensor, W 64 or 32");
  const int64_t width = weight.size(2), N = weight.size(0) * width, K = weight.size(1) * 2;
  TORCH_CHECK_VALUE(x.dim() == 2 && rows_fit<Bf16Pairs>(x, N, K, std::nullopt),
                    "x: bfloat16 [rows, ", K, "] rows of whole input pairs");
  TORCH_CHECK_VALUE(!bias || rows_fit<Bf16Pairs>(x, N, K, bias),
                    "bias: a contiguous bfloat16 [", N, "]");
  return blocked_gemv<Bf16Pairs>(x, static_cast<const uint32_t*>(weight.data_ptr()), width, N, K,
                                 bias ? *bias : at::Tensor());
#else
  (void)x, (void)weight, (void)bias;
  TORCH_CHECK(false, "blocked_linear needs a CPU with AVX512-BF16");
#endif
}
