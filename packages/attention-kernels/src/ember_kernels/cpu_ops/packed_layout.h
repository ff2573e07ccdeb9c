// Which layout oneDNN packed a weight in, and where its bytes are (packed_layout.cpp): what the
// streaming kernel (packed_gemv.cpp) and the AMX tiles (amx_gemm.cpp) read in place.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ember_packed {

// The bytes of a weight packed by oneDNN (an mkldnn tensor), as 32-bit units.
const uint32_t* packed_bytes(const at::Tensor& weight);

// The width (64 or 32) of the blocked layout [N / W][K / u][W][u] that oneDNN packed a bfloat16
// (u = 2) or float32 (u = 1) weight [N, K] in; 0 for another layout, a plain tensor, or a dtype
// this build's kernels do not multiply. Settled by the first weight of each shape and dtype whose
// values fit one layout only, as oneDNN lays out every weight of one shape alike.
int64_t packed_width(const at::Tensor& weight);

}  // namespace ember_packed
