// bfloat16 steps of a few to 32 rows on oneDNN's 32-wide packed layout in AMX tiles
// (amx_gemm.cpp), which packed_linear runs where it applies (see packed_gemv.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

// The block width of the layout the tiles read: oneDNN's on CPUs with AMX ([N / 32][K / 2][32][2],
// each block's input pairs in the order an AMX tile's rows want them).
constexpr int64_t AMX_GEMM_WIDTH = 32;
// Inputs per tile step: a tile row holds 32 bfloat16 values; K must be a multiple of it.
constexpr int64_t AMX_GEMM_DEPTH = 32;
// The most rows one call takes: two tiles of 16 rows each.
constexpr int64_t AMX_GEMM_ROWS = 32;

// Whether this build has AMX-BF16 tiles and the operating system lets this process use them
// (asked once: Linux hands the tile state out per process on request).
bool amx_tiles_ready();

// y [M, N] (row stride y_stride) = x [M, K] (row stride x_stride) w^T + bias, w in the 32-wide
// blocked layout; 1 <= M <= AMX_GEMM_ROWS, N a multiple of AMX_GEMM_WIDTH, K of AMX_GEMM_DEPTH,
// bias (nullptr: none) [N]. Sums in float32, rounded once. Blocks split between the threads.
void amx_gemm(const c10::BFloat16* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t N,
              int64_t K, const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_stride);
