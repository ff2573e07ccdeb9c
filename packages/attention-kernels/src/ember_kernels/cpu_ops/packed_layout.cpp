// Which layout oneDNN packed a weight in, and its bytes: the streaming kernel (packed_gemv.cpp) and
// the AMX tiles (amx_gemm.cpp) read oneDNN's packed bytes in place, in the blocked layouts
// [N / W][K / u][W][u] (u inputs to a 32-bit unit: a pair of bfloat16 or one float32; W = 64
// where oneDNN runs AVX-512, 32 where it runs AMX tiles). The layout is oneDNN's choice, opaque
// to torch, so it is checked byte for byte against the weight's own values (to_dense) for the
// first weight of each shape and dtype: oneDNN picks a layout from the shape, dtype and CPU,
// never the values.

#include "packed_layout.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

// The bytes behind an opaque oneDNN tensor (exported by libtorch_cpu; weak, so a torch without
// them builds and runs oneDNN's matmul).
namespace at::native {
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor) __attribute__((weak));
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor) __attribute__((weak));
}  // namespace at::native

namespace {

// Whether `stored` holds the values of `plain` [N][units] (32-bit units: units of bfloat16, or float32) in the
// blocked layout of width `width` (0: plain's own layout), compared in the stored order, blocks
// split between the threads (the LM head's check is a first decode step's cost).
bool bytes_are_blocked(const uint32_t* plain, const uint32_t* stored, int64_t N, int64_t units,
                       int64_t width) {
  if (width == 0) return std::memcmp(plain, stored, N * units * 4) == 0;
  if (N % width != 0) return false;
  std::atomic<bool> same{true};
  at::parallel_for(0, N / width, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end && same.load(std::memory_order_relaxed); ++block) {
      const uint32_t* packed = stored + block * units * width;
      const uint32_t* rows = plain + block * width * units;
      bool equal = true;
      for (int64_t u = 0; u < units && equal; ++u) {
        for (int64_t lane = 0; lane < width; ++lane) {
          equal &= packed[u * width + lane] == rows[lane * units + u];
        }
      }
      if (!equal) same.store(false, std::memory_order_relaxed);
    }
  });
  return same.load();
}

// The layouts a weight's bytes are compared with: the two the kernels read, and two decoys, so
// that a weight whose values fit several (all equal, say) settles nothing.
constexpr int64_t LAYOUT_WIDTHS[] = {64, 32, 16, 0};

// Which of the kernels' widths (64 or 32) `stored` holds `plain`'s values in (0: another layout),
// and whether that settles the layout of their shape: not where the values fit more than one of
// LAYOUT_WIDTHS (reading this weight at the width found is right all the same).
std::pair<int64_t, bool> stored_block_width(const uint32_t* plain, const uint32_t* stored,
                                            int64_t N, int64_t units) {
  int64_t readable = 0, matches = 0;
  for (const int64_t width : LAYOUT_WIDTHS) {
    if (bytes_are_blocked(plain, stored, N, units, width)) {
      ++matches;
      if (readable == 0 && (width == 64 || width == 32)) readable = width;
    }
  }
  return {readable, matches <= 1};
}

}  // namespace

namespace ember_packed {

const uint32_t* packed_bytes(const at::Tensor& weight) {
  return static_cast<const uint32_t*>(at::native::data_ptr_from_mkldnn(weight));
}

int64_t packed_width(const at::Tensor& weight) {
  if (at::native::data_ptr_from_mkldnn == nullptr || at::native::nbytes_from_mkldnn == nullptr ||
      !weight.is_mkldnn() || weight.dim() != 2) {
    return 0;
  }
  const at::ScalarType dtype = weight.scalar_type();
#if defined(__AVX512BF16__)
  const bool readable = dtype == at::kBFloat16 || dtype == at::kFloat;
#elif defined(__AVX512F__)
  const bool readable = dtype == at::kFloat;
#else
  const bool readable = false;
#endif
  const int64_t per_unit = dtype == at::kBFloat16 ? 2 : 1;
  const int64_t N = weight.size(0), K = weight.size(1);
  if (!readable || N % 32 != 0 || K % per_unit != 0 ||
      at::native::nbytes_from_mkldnn(weight) != N * K * weight.element_size()) {
    return 0;
  }
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, at::ScalarType>, int64_t> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({N, K, dtype});
  if (found != known.end()) return found->second;
  const at::Tensor dense = weight.to_dense();
  const auto [width, settled] =
      stored_block_width(static_cast<const uint32_t*>(dense.data_ptr()), packed_bytes(weight), N,
                         K / per_unit);
  if (settled) known.emplace(std::make_tuple(N, K, dtype), width);
  return width;
}

}  // namespace ember_packed

int64_t packed_block_width(const at::Tensor& weight) { return ember_packed::packed_width(weight); }

int64_t block_width_of(const at::Tensor& weight, const at::Tensor& stored) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                        weight.is_contiguous() && weight.size(1) % 2 == 0,
                    "weight: a contiguous bfloat16 [out, in] tensor with even in");
  TORCH_CHECK_VALUE(stored.scalar_type() == at::kBFloat16 && stored.is_contiguous() &&
                        stored.numel() == weight.numel(),
                    "stored: a contiguous bfloat16 tensor of weight's size");
  const auto [width, settled] =
      stored_block_width(reinterpret_cast<const uint32_t*>(weight.data_ptr<c10::BFloat16>()),
                         reinterpret_cast<const uint32_t*>(stored.data_ptr<c10::BFloat16>()),
                         weight.size(0), weight.size(1) / 2);
  return settled ? width : 0;
}

