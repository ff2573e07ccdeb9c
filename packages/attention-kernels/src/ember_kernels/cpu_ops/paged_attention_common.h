// What paged_attention.cpp and its prefill layout (attend_columns.h) share: the call's
// parameters, the work items, per-thread scratch and the reads of K/V rows from the pages.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace ember_paged {

using namespace ember_vec;

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t CHUNK = 64;    // keys per online-softmax step
constexpr int64_t TILE_ROWS = 64;  // query rows (tokens x heads per KV head) per prefill item

struct Params {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  void* out;
  const int32_t* block_table;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  int64_t bt_stride;
  int64_t block_size, kv_heads, group, head_size;
  int64_t cache_stride_block, cache_stride_slot;  // in elements; a head's row is contiguous
  float scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
};

struct Item {
  int64_t seq, kv_head, first_token, num_tokens, cost;
};

// Per-thread scratch, grown as needed and kept between calls.
struct Scratch {
  std::vector<float> q, s, o, m, l, pos, kconv, vconv;
  std::vector<const float*> krows, vrows;
  std::vector<c10::BFloat16> qb;
  std::vector<uint32_t> pairs;  // bfloat16 probability pairs of the decode PV product
  std::vector<const c10::BFloat16*> kraw, vraw, ahead, after_rows;
};

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Pointers to the float rows of keys [k0, k0 + n) of one KV head; half-precision rows are first
// converted into ``conv`` (a chunk-sized scratch, not a gather of the sequence).
template <typename T>
void chunk_rows(
    const Params& p, const T* cache, const int32_t* blocks, int64_t kv_head, int64_t k0, int64_t n,
    std::vector<float>& conv, const float** rows) {
  const int64_t D = p.head_size;
  int64_t page = k0 / p.block_size, slot = k0 % p.block_size;
  for (int64_t j = 0; j < n; ++j) {
    const T* src =
        cache + blocks[page] * p.cache_stride_block + slot * p.cache_stride_slot + kv_head * D;
    if (++slot == p.block_size) slot = 0, ++page;
    if constexpr (std::is_same_v<T, float>) {
      rows[j] = src;
    } else {
      float* dst = conv.data() + j * D;
      int64_t d = 0;
      for (; d + VW <= D; d += VW) store(dst + d, load_as_float(src + d));
      for (; d < D; ++d) dst[d] = to_float(src[d]);
      rows[j] = dst;
    }
  }
}

// Pointers to the rows of keys [k0, k0 + n) of one KV head, in place.
template <typename T>
void page_rows(const Params& p, const T* cache, const int32_t* blocks, int64_t kv_head, int64_t k0,
               int64_t n, const T** rows) {
  int64_t page = k0 / p.block_size, slot = k0 % p.block_size;
  for (int64_t j = 0; j < n; ++j) {
    rows[j] = cache + blocks[page] * p.cache_stride_block + slot * p.cache_stride_slot +
              kv_head * p.head_size;
    if (++slot == p.block_size) slot = 0, ++page;
  }
}

// Decode reads each key and value once, from pages scattered over the cache, which the hardware
// prefetcher cannot follow: the float scores loop asks for the keys PREFETCH_AHEAD ahead and for
// the values of the keys it is scoring (the output pass reads them next); the bfloat16 one asks
// for the next chunk's keys and values (and, in an item's first chunk, its own). 1.3x on a
// decode step whose KV is out of the caches.
constexpr int64_t PREFETCH_AHEAD = 8;

inline void prefetch_row(const float* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(float)); b += 64) {
    __builtin_prefetch(bytes + b, 0, 3);
  }
}


// One online-softmax step of a row: its n scores ``sr`` become exp(score - running max) in place,
// and the row's running max ``m``, sum ``l`` and output ``o`` [D] are brought to the new max.
inline void softmax_step(float* sr, int64_t n, float& m, float& l, float* o, int64_t D) {
  vf vmx = splat(m);
  int64_t j = 0;
  for (; j + VW <= n; j += VW) vmx = vmax(vmx, load(sr + j));
  float mx = hmax(vmx);
  for (; j < n; ++j) mx = std::max(mx, sr[j]);
  // A row that has seen only masked keys so far keeps weight 0 (no inf - inf).
  const float m_use = mx == NEG_INF ? 0.f : mx;
  const float alpha = exp_nonpositive(m - m_use);
  vf vsum = splat(0.f);
  for (j = 0; j + VW <= n; j += VW) {
    const vf e = exp_nonpositive(load(sr + j) - m_use);
    store(sr + j, e);
    vsum += e;
  }
  float sum = hsum(vsum);
  for (; j < n; ++j) {
    sr[j] = exp_nonpositive(sr[j] - m_use);
    sum += sr[j];
  }
  l = l * alpha + sum;
  m = mx;
  if (alpha != 1.f) {
    for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
  }
}

inline void soft_cap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

}  // namespace ember_paged
