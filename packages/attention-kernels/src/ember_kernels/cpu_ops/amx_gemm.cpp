// AMX tiles for the bfloat16 steps of a decode batch (3-32 rows) on oneDNN's packed weights.
// With AMX, oneDNN packs a bfloat16 linear weight in blocks of 32 output channels whose input
// pairs come in the order an AMX B tile wants ([N / 32][K / 2][32][2]: 16 pairs of a block are a
// tile of 16 rows, 64 bytes of each 128-byte row per 16 channels), so the weight streams from
// memory straight into tiles, once per step, in stored order. oneDNN's own matmul at these sizes
// read the weight well below the memory's speed (benchmarks/bench_packed_gemv.py).
//
// Per block of 32 channels: C tiles 0-1 hold rows 0-15 (channels 0-15, 16-31), tiles 2-3 rows
// 16-31; tiles 4-5 the rows of x, 6-7 the two halves of the block's 16 input pairs.

#include "amx_gemm.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;
// How far ahead of the tiles each block's stream is asked for in L2: two tile steps (a step
// reads 16 rows of 128 bytes).
constexpr int64_t PREFETCH_AHEAD = 2 * 16 * 128;

// The tile configuration (palette 1): rows and bytes per row of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig config_for(int64_t M) {
  TileConfig config;
  const auto top = static_cast<uint8_t>(std::min<int64_t>(M, 16));
  const auto bottom = static_cast<uint8_t>(M > 16 ? M - 16 : 0);
  for (int tile : {0, 1, 4}) config.rows[tile] = top, config.colsb[tile] = 64;
  if (bottom) {
    for (int tile : {2, 3, 5}) config.rows[tile] = bottom, config.colsb[tile] = 64;
  }
  for (int tile : {6, 7}) config.rows[tile] = 16, config.colsb[tile] = 64;
  return config;
}

// One block of 32 channels for M rows (TWO: M > 16), its float32 sums stored to sums [M][32].
template <bool TWO>
void block_sums(const c10::BFloat16* x, int64_t x_stride, const uint16_t* block, int64_t K,
                float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_bytes = x_stride * 2;
  for (int64_t k = 0; k < K; k += AMX_GEMM_DEPTH) {
    const uint16_t* pairs = block + k * AMX_GEMM_WIDTH;  // 16 rows of 32 channels x 2 inputs
    const char* ahead = reinterpret_cast<const char*>(pairs) + PREFETCH_AHEAD;
    for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    _tile_loadd(4, x + k, x_bytes);
    _tile_loadd(6, pairs, 128);
    _tile_loadd(7, pairs + 32, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, x + 16 * x_stride + k, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  if constexpr (TWO) {
    _tile_stored(2, sums + 16 * 32, 128);
    _tile_stored(3, sums + 16 * 32 + 16, 128);
  }
}

template <bool TWO>
void blocks(int64_t begin, int64_t end, const c10::BFloat16* x, int64_t x_stride, int64_t M,
            const uint16_t* w, int64_t K, const c10::BFloat16* bias, c10::BFloat16* y,
            int64_t y_stride) {
  alignas(64) float sums[AMX_GEMM_ROWS * AMX_GEMM_WIDTH];
  for (int64_t block = begin; block < end; ++block) {
    block_sums<TWO>(x, x_stride, w + block * AMX_GEMM_WIDTH * K, K, sums);
    for (int half = 0; half < 2; ++half) {
      const int64_t col = block * AMX_GEMM_WIDTH + 16 * half;
      const __m512 add =
          bias != nullptr ? ember_vec::load_as_m512(bias + col) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const __m512 sum = _mm512_add_ps(_mm512_load_ps(sums + m * 32 + 16 * half), add);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * y_stride + col),
                            (__m256i)_mm512_cvtneps_pbh(sum));
      }
    }
  }
}

}  // namespace

bool amx_tiles_ready() {
  static const bool ready =
      syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ready;
}

void amx_gemm(const c10::BFloat16* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t N,
              int64_t K, const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_stride) {
  const TileConfig config = config_for(M);
  at::parallel_for(0, N / AMX_GEMM_WIDTH, 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&config);  // per thread: the tile state is each thread's own
    if (M > 16) {
      blocks<true>(begin, end, x, x_stride, M, w, K, bias, y, y_stride);
    } else {
      blocks<false>(begin, end, x, x_stride, M, w, K, bias, y, y_stride);
    }
    _tile_release();
  });
}

#else

bool amx_tiles_ready() { return false; }

void amx_gemm(const c10::BFloat16*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
              const c10::BFloat16*, c10::BFloat16*, int64_t) {
  TORCH_CHECK(false, "amx_gemm: this build has no AMX-BF16 tiles (see amx_tiles_ready)");
}

#endif
