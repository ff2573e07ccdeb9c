// y = x W^T (+ b) on a weight packed for oneDNN (ember_kernels.packed_linear), and Ember's own
// path for the rows of a decode step in bfloat16: a step of one token reads every weight once,
// so it runs at the speed memory streams the weight in. oneDNN's matmul reached 0.5-0.8 of a
// summing loop's read bandwidth at one row, and below its large-batch rate at 8-32 rows
// (benchmarks/bench_packed_gemv.py); here each thread streams its equal share of blocks one after
// another, straight from the packed bytes (no second copy), with AVX512-BF16 dot products into
// float32, a block's rows in register tiles while its weights are in cache.
//
// The packed layout is oneDNN's choice, opaque to torch. Whether it is the one read here (blocks
// of BLOCK output channels, each holding pairs of inputs for its BLOCK channels in turn:
// [N / BLOCK][K / 2][BLOCK][2]) is checked byte for byte against the weight's own values
// (to_dense) for the first weight of each shape: oneDNN picks a layout from the shape, dtype and
// CPU, never the values. Any other layout, CPU or dtype runs oneDNN's matmul.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include "bf16_dot.h"
#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

// The bytes behind an opaque oneDNN tensor (exported by libtorch_cpu; weak, so a torch without
// them builds and runs oneDNN's matmul).
namespace at::native {
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor) __attribute__((weak));
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor) __attribute__((weak));
}  // namespace at::native

namespace {

constexpr int64_t BLOCK = 64;  // output channels per block of the packed layout
// How far ahead of each block's stream a one-row step asks for the weight in L2: the hardware
// prefetchers alone keep too few lines in flight for one core to stream at the memory's speed
// (the A/B is in the package README).
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

#if defined(__AVX512BF16__)

const uint16_t* packed_bytes(const at::Tensor& weight) {
  return static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(weight));
}

// Whether the packed bytes of weight [N, K] are its values in the layout read here: compared a
// pair of inputs (32 bits) at a time in the packed order, blocks split between the threads (the
// LM head's check is a first decode step's cost).
bool bytes_are_blocked(const at::Tensor& weight) {
  const int64_t N = weight.size(0), pairs = weight.size(1) / 2;
  const at::Tensor dense = weight.to_dense();
  const auto* plain = reinterpret_cast<const uint32_t*>(dense.data_ptr<c10::BFloat16>());
  const auto* raw = reinterpret_cast<const uint32_t*>(packed_bytes(weight));
  std::atomic<bool> same{true};
  at::parallel_for(0, N / BLOCK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end && same.load(std::memory_order_relaxed); ++block) {
      const uint32_t* packed = raw + block * pairs * BLOCK;
      const uint32_t* rows = plain + block * BLOCK * pairs;
      bool equal = true;
      for (int64_t kp = 0; kp < pairs; ++kp) {
        for (int64_t lane = 0; lane < BLOCK; ++lane) {
          equal &= packed[kp * BLOCK + lane] == rows[lane * pairs + kp];
        }
      }
      if (!equal) same.store(false, std::memory_order_relaxed);
    }
  });
  return same.load();
}

// Whether weight [N, K] is packed in the layout read here: settled by the first weight of each
// shape, as oneDNN lays out every weight of one shape alike.
bool blocked_layout(const at::Tensor& weight) {
  if (at::native::data_ptr_from_mkldnn == nullptr || at::native::nbytes_from_mkldnn == nullptr ||
      weight.dim() != 2 || weight.scalar_type() != at::kBFloat16) {
    return false;
  }
  const int64_t N = weight.size(0), K = weight.size(1);
  if (N % BLOCK != 0 || K % 2 != 0 || at::native::nbytes_from_mkldnn(weight) != N * K * 2) {
    return false;
  }
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({N, K});
  if (found != known.end()) return found->second;
  const bool blocked = bytes_are_blocked(weight);
  known.emplace(std::make_pair(N, K), blocked);
  return blocked;
}

inline __m512 bf16x16_as_float(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Output channels [block * BLOCK, (block + B) * BLOCK) of M rows: for each pair of inputs, the
// pair of each row broadcast and dotted with the next BLOCK channels' pairs (four vectors per
// block), so the weight streams through once, in its stored order; one row also prefetches each
// block's stream PREFETCH_BYTES ahead (past a weight's end a prefetch reads nothing, and never
// faults).
template <int M, int B>
void gemv_blocks(const uint32_t* x, int64_t x_stride, const uint16_t* w, int64_t K,
                 const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_stride) {
  __m512 acc[M][B][4];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < 4; ++i) acc[m][b][i] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh xs[M];
    for (int m = 0; m < M; ++m) xs[m] = (__m512bh)_mm512_set1_epi32(x[m * x_stride + kp]);
    for (int b = 0; b < B; ++b) {
      const uint16_t* line = w + (b * pairs + kp) * BLOCK * 2;
      if constexpr (M == 1) {
        const char* ahead = reinterpret_cast<const char*>(line) + PREFETCH_BYTES;
        for (int i = 0; i < 4; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T1);
      }
      for (int i = 0; i < 4; ++i) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(line + 32 * i);
        for (int m = 0; m < M; ++m) acc[m][b][i] = _mm512_dpbf16_ps(acc[m][b][i], xs[m], wv);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < 4; ++i) {
      const int64_t col = b * BLOCK + 16 * i;
      const __m512 add = bias != nullptr ? bf16x16_as_float(bias + col) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * y_stride + col),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][b][i], add)));
      }
    }
  }
}

// Blocks [begin, end): four at a time for one row, two for two (more streams in flight; the
// accumulators of more rows fill the registers), one at a time above.
template <int M>
void gemv_range(int64_t begin, int64_t end, const uint32_t* x, int64_t x_stride,
                const uint16_t* w, int64_t K, const c10::BFloat16* bias, c10::BFloat16* y,
                int64_t y_stride) {
  constexpr int B = M == 1 ? 4 : M == 2 ? 2 : 1;
  int64_t block = begin;
  for (; block + B <= end; block += B) {
    gemv_blocks<M, B>(x, x_stride, w + block * BLOCK * K, K,
                      bias ? bias + block * BLOCK : nullptr, y + block * BLOCK, y_stride);
  }
  for (; block < end; ++block) {
    gemv_blocks<M, 1>(x, x_stride, w + block * BLOCK * K, K,
                      bias ? bias + block * BLOCK : nullptr, y + block * BLOCK, y_stride);
  }
}

// Blocks [begin, end) for any number of rows: each block's rows in tiles of at most ROW_TILE
// (what the registers hold beside a block's four weight vectors), so the first tile streams the
// block's weights in from memory and the others read them again from cache.
template <int ROW_TILE>
void gemm_range(int64_t begin, int64_t end, int64_t rows, const uint32_t* x, int64_t x_stride,
                const uint16_t* w, int64_t K, const c10::BFloat16* bias, c10::BFloat16* y,
                int64_t y_stride) {
  for (int64_t block = begin; block < end; ++block) {
    const uint16_t* wb = w + block * BLOCK * K;
    const c10::BFloat16* bb = bias ? bias + block * BLOCK : nullptr;
    for (int64_t row = 0; row < rows; row += ROW_TILE) {
      const uint32_t* xr = x + row * x_stride;
      c10::BFloat16* yr = y + row * y_stride + block * BLOCK;
      switch (std::min<int64_t>(ROW_TILE, rows - row)) {
        case 1: gemv_blocks<1, 1>(xr, x_stride, wb, K, bb, yr, y_stride); break;
        case 2: gemv_blocks<2, 1>(xr, x_stride, wb, K, bb, yr, y_stride); break;
        case 3: gemv_blocks<3, 1>(xr, x_stride, wb, K, bb, yr, y_stride); break;
        case 4: gemv_blocks<4, 1>(xr, x_stride, wb, K, bb, yr, y_stride); break;
        case 5: gemv_blocks<5, 1>(xr, x_stride, wb, K, bb, yr, y_stride); break;
        default: gemv_blocks<ROW_TILE, 1>(xr, x_stride, wb, K, bb, yr, y_stride); break;
      }
    }
  }
}

at::Tensor packed_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xs = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const int64_t x_stride = x.stride(0) / 2;
  const uint16_t* w = packed_bytes(weight);
  const c10::BFloat16* b = bias.defined() ? bias.data_ptr<c10::BFloat16>() : nullptr;
  auto* out = y.data_ptr<c10::BFloat16>();
  // Equal shares of blocks, so both threads finish together (the head's 2,374 blocks, a down
  // projection's 14).
  at::parallel_for(0, N / BLOCK, 1, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: gemv_range<1>(begin, end, xs, x_stride, w, K, b, out, N); break;
      case 2: gemv_range<2>(begin, end, xs, x_stride, w, K, b, out, N); break;
      case 3: gemv_range<3>(begin, end, xs, x_stride, w, K, b, out, N); break;
      case 4: gemv_range<4>(begin, end, xs, x_stride, w, K, b, out, N); break;
      default: gemm_range<GEMM_ROW_TILE>(begin, end, M, xs, x_stride, w, K, b, out, N); break;
    }
  });
  return y;
}

#endif  // __AVX512BF16__

}  // namespace

bool packed_gemv_applies(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  return weight.is_mkldnn() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
         x.size(0) >= 1 && x.size(0) <= PACKED_GEMV_MAX_ROWS && x.stride(1) == 1 &&
         x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0 &&
         x.size(1) == weight.size(1) &&
         (!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == weight.size(0))) &&
         blocked_layout(weight);
#else
  (void)x, (void)weight, (void)bias;
  return false;
#endif
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  if (packed_gemv_applies(x, weight, bias)) {
    return packed_gemv(x, weight, bias ? *bias : at::Tensor());
  }
#endif
  return onednn_matmul(x, weight, bias);
}
