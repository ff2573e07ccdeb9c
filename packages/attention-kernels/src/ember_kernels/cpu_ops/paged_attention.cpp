// Paged attention for CPU tensors: K and V are read in place from the paged cache through the
// block table (no gather copy), every sequence attends only its own length (no padding), and
// prefill, chunked prefill and decode share one call.
//
// Work is cut into items (sequence, KV head, tile of query tokens); the query heads sharing the KV
// head are folded into the tile's rows, so each key and value is read once per KV head (GQA
// without repeats). Items run on torch's intra-op threads, biggest first, taken from a shared
// counter. Each item walks its visible keys in chunks with an online softmax in float32.
//
// Two layouts of the same algorithm: tiles with at least one vector of rows (prefill) keep their
// queries, probabilities and output transposed ([head_size][rows], [keys][rows]) so that every
// inner loop is a broadcast-multiply-add over a vector of rows; smaller tiles (decode) keep them
// row-major and vectorize over head_size (the prefill layout is in attend_columns.h, what both
// share in paged_attention_common.h). Vectors are GCC vector extensions of the widest width
// the build target has (vec.h; the build is per CPU: see build.py).
//
// float16/bfloat16 K/V are converted to float32 a chunk at a time, and softmax and accumulation
// are float32. Where the build target has AVX512-BF16, decode reads bfloat16 keys and values in
// place instead (bf16_dot.h): scores by its dot products (pairs of bfloat16 products summed in
// float32), and the probabilities, rounded to bfloat16, dotted with pairs of value rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "attend_columns.h"
#include "bf16_dot.h"
#include "kernels.h"
#include "paged_attention_common.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using namespace ember_paged;

// The keys an item's rows see: [first, end), the window's start to its last token's position.
std::pair<int64_t, int64_t> item_keys(const Params& p, const Item& it) {
  const int64_t q_len = p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq];
  const int64_t first_pos = p.seq_lens[it.seq] - q_len + it.first_token;
  const int64_t first = p.window ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  return {first, first_pos + it.num_tokens};
}

#if EMBER_BF16_DOT
// bfloat16 rows of keys [k0, k0 + n) and of the next chunk's keys, with the rows their scores
// pass asks for ahead (bf16_dot_scores): in an item's first chunk its own keys past the first
// eight and its values, always the next chunk's keys and values, and in its last chunk the first
// chunk's keys and values of the item the thread runs next (`after`, if any): asked for only as
// that item starts, they come too late for its first keys (the A/B is in the package README).
void bf16_chunk_rows(const Params& p, const int32_t* blocks, int64_t kv_head, int64_t k0,
                     int64_t n, int64_t end, bool first_chunk, const Item* after, Scratch& w) {
  using BF = c10::BFloat16;
  const BF* keys = static_cast<const BF*>(p.key_cache);
  const BF* values = static_cast<const BF*>(p.value_cache);
  const int64_t span = std::min(2 * CHUNK, end - k0), next = span - n;
  page_rows(p, keys, blocks, kv_head, k0, span, w.kraw.data());
  page_rows(p, values, blocks, kv_head, k0, span, w.vraw.data());
  w.ahead.clear();
  if (first_chunk) {
    w.ahead.insert(w.ahead.end(), w.kraw.begin() + std::min<int64_t>(8, n), w.kraw.begin() + n);
    w.ahead.insert(w.ahead.end(), w.vraw.begin(), w.vraw.begin() + n);
  }
  w.ahead.insert(w.ahead.end(), w.kraw.begin() + n, w.kraw.begin() + n + next);
  w.ahead.insert(w.ahead.end(), w.vraw.begin() + n, w.vraw.begin() + n + next);
  if (next == 0 && after != nullptr) {
    const auto [first, stop] = item_keys(p, *after);
    const int64_t count = std::min(CHUNK, stop - first);
    const int32_t* after_blocks = p.block_table + after->seq * p.bt_stride;
    w.after_rows.resize(2 * CHUNK);
    page_rows(p, keys, after_blocks, after->kv_head, first, count, w.after_rows.data());
    page_rows(p, values, after_blocks, after->kv_head, first, count,
              w.after_rows.data() + count);
    w.ahead.insert(w.ahead.end(), w.after_rows.begin(), w.after_rows.begin() + 2 * count);
  }
}
#endif

// Decode layout: few rows (one token's heads of the group), vectorized over head_size.
// q: [M][D], s: [M][CHUNK], o: [M][D].
template <typename T>
void attend_rows(const Params& p, const Item& it, const Item* after, Scratch& w) {
  const int64_t D = p.head_size, G = p.group, M = it.num_tokens * G;
  const int64_t Dv = D / VW * VW;
  const auto [k_begin, key_end] = item_keys(p, it);
  const int64_t last_pos = key_end - 1, first_pos = key_end - it.num_tokens;
  const int32_t* blocks = p.block_table + it.seq * p.bt_stride;
  const T* query = static_cast<const T*>(p.query);

  // bfloat16 keys and values read in place: scores by AVX512-BF16 dot products (the query kept
  // in bfloat16, the scale applied to the float32 dot), probabilities by pairs of value rows.
  constexpr bool native_bf16 = ember_bf16::BF16_DOT && std::is_same_v<T, c10::BFloat16>;
  const bool in_place = native_bf16 && D % 32 == 0;
  w.q.resize(M * D);
  w.s.resize(M * CHUNK);
  w.o.assign(M * D, 0.f);
  w.m.assign(M, NEG_INF);
  w.l.assign(M, 0.f);
  if (in_place) {
    w.qb.resize(M * D);
    w.pairs.resize(M * CHUNK / 2);
    w.kraw.resize(2 * CHUNK);
    w.vraw.resize(2 * CHUNK);
  } else {
    w.krows.resize(CHUNK);
    w.vrows.resize(CHUNK);
    if constexpr (!std::is_same_v<T, float>) {
      w.kconv.resize(CHUNK * D);
      w.vconv.resize(CHUNK * D);
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = r / G, h = it.kv_head * G + r % G;
    const T* src = query + (p.query_start_loc[it.seq] + it.first_token + t) * p.q_stride_token +
                   h * p.q_stride_head;
    if (in_place) {
      std::memcpy(w.qb.data() + r * D, src, D * sizeof(T));
      continue;
    }
    int64_t d = 0;
    for (; d < Dv; d += VW) store(w.q.data() + r * D + d, load_as_float(src + d) * p.scale);
    for (; d < D; ++d) w.q[r * D + d] = to_float(src[d]) * p.scale;
  }
  float* q = w.q.data();
  float* s = w.s.data();
  float* o = w.o.data();
  for (int64_t k0 = k_begin; k0 <= last_pos; k0 += CHUNK) {
    const int64_t n = std::min(CHUNK, last_pos + 1 - k0);
    const float* const* kr = w.krows.data();
    const float* const* vr = w.vrows.data();
#if EMBER_BF16_DOT
    if constexpr (native_bf16) {
      if (in_place) {
        bf16_chunk_rows(p, blocks, it.kv_head, k0, n, last_pos + 1, k0 == k_begin, after, w);
        ember_bf16::bf16_dot_scores(w.qb.data(), M, D, w.kraw.data(), n, p.scale, s, CHUNK,
                                    w.ahead.data(), static_cast<int64_t>(w.ahead.size()));
      }
    }
#endif
    if (!in_place) {
      chunk_rows<T>(p, static_cast<const T*>(p.value_cache), blocks, it.kv_head, k0, n, w.vconv,
                    w.vrows.data());
      chunk_rows<T>(p, static_cast<const T*>(p.key_cache), blocks, it.kv_head, k0, n, w.kconv,
                    w.krows.data());
    }
    // Scores, two rows by four keys at a time (a tail repeats its last row or key).
    for (int64_t r = 0; r < (in_place ? 0 : M); r += 2) {
      const float* q0 = q + r * D;
      const float* q1 = q + std::min(r + 1, M - 1) * D;
      for (int64_t j = 0; j < n; j += 4) {
        const float* k[4];
        for (int i = 0; i < 4; ++i) k[i] = kr[std::min(j + i, n - 1)];
        if (r == 0) {  // the first pass over the chunk's keys asks for what comes next
          for (int i = 0; i < 4; ++i) {
            prefetch_row(kr[std::min(j + PREFETCH_AHEAD + i, n - 1)], D);
            prefetch_row(vr[std::min(j + i, n - 1)], D);
          }
        }
        vf a[2][4] = {};
        for (int64_t d = 0; d < Dv; d += VW) {
          const vf x0 = load(q0 + d), x1 = load(q1 + d);
          for (int i = 0; i < 4; ++i) {
            const vf kd = load(k[i] + d);
            a[0][i] += x0 * kd;
            a[1][i] += x1 * kd;
          }
        }
        for (int64_t rr = 0; rr < std::min<int64_t>(2, M - r); ++rr) {
          const float* qr = rr ? q1 : q0;
          for (int64_t i = 0; i < std::min<int64_t>(4, n - j); ++i) {
            float dot = hsum(a[rr][i]);
            for (int64_t d = Dv; d < D; ++d) dot += qr[d] * k[i][d];
            s[(r + rr) * CHUNK + j + i] = dot;
          }
        }
      }
    }
    // Only a chunk that reaches past a row's position or before its window needs a mask (a
    // decode row sees every key up to its own).
    const bool masked = k0 + n - 1 > first_pos || (p.window && k0 <= last_pos - p.window);
    for (int64_t r = 0; r < M; ++r) {
      float* sr = s + r * CHUNK;
      if (p.soft_cap > 0.f) soft_cap_scores(sr, n, p.soft_cap);
      if (masked) {
        const int64_t pos = first_pos + r / G;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t key = k0 + j;
          if (key > pos || (p.window && key <= pos - p.window)) sr[j] = NEG_INF;
        }
      }
      softmax_step(sr, n, w.m[r], w.l[r], o + r * D, D);
    }
#if EMBER_BF16_DOT
    if constexpr (native_bf16) {
      if (in_place) ember_bf16::bf16_pv(s, M, CHUNK, w.vraw.data(), n, o, D, w.pairs.data());
    }
#endif
    // o[r] += sum_j s[r][j] * v_j: two rows by four vectors of head dims held in registers over
    // the chunk (a tail repeats its last row or vector and stores it once more, unchanged).
    for (int64_t r = 0; r < (in_place ? 0 : M); r += 2) {
      const int64_t r1 = std::min(r + 1, M - 1);
      for (int64_t d = 0; d < Dv; d += 4 * VW) {
        int64_t off[4];
        for (int i = 0; i < 4; ++i) off[i] = std::min<int64_t>(d + i * VW, Dv - VW);
        vf a[2][4];
        for (int i = 0; i < 4; ++i) {
          a[0][i] = load(o + r * D + off[i]);
          a[1][i] = load(o + r1 * D + off[i]);
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* v = vr[j];
          const float p0 = s[r * CHUNK + j], p1 = s[r1 * CHUNK + j];
          for (int i = 0; i < 4; ++i) {
            const vf vd = load(v + off[i]);
            a[0][i] += vd * p0;
            a[1][i] += vd * p1;
          }
        }
        for (int i = 0; i < 4; ++i) {
          store(o + r * D + off[i], a[0][i]);
          store(o + r1 * D + off[i], a[1][i]);
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = Dv; d < D; ++d) {
          o[r * D + d] += vr[j][d] * s[r * CHUNK + j];
          if (r1 != r) o[r1 * D + d] += vr[j][d] * s[r1 * CHUNK + j];
        }
      }
    }
  }
  T* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = r / G, h = it.kv_head * G + r % G;
    T* dst = out + (p.query_start_loc[it.seq] + it.first_token + t) * p.out_stride_token +
             h * p.out_stride_head;
    const float inv = 1.f / w.l[r];
    const float* row = o + r * D;
#if EMBER_BF16_DOT
    if (in_place) {  // o is in bf16_pv's pair order: back to dims in order, scaled
      ember_bf16::pair_order_to_dims(row, D, inv, w.q.data());
      for (int64_t d = 0; d < D; d += VW) store_as(dst + d, load(w.q.data() + d));
      continue;
    }
#endif
    int64_t d = 0;
    for (; d < Dv; d += VW) store_as(dst + d, load(row + d) * inv);
    for (; d < D; ++d) dst[d] = static_cast<T>(row[d] * inv);
  }
}

template <typename T>
void run_items(const Params& p, const std::vector<Item>& items) {
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), total);
  // Each thread holds the item it runs next while it runs one, so that the decode layout can ask
  // for the held item's first keys ahead.
  auto work = [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < total;) {
      const int64_t held = next.fetch_add(1);
      const Item& it = items[i];
      if (it.num_tokens * p.group >= VW) {
        attend_columns<T>(p, it, scratch);
      } else {
        attend_rows<T>(p, it, held < total ? &items[held] : nullptr, scratch);
      }
      i = held;
    }
  };
  if (workers <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, workers, 1, work);
  }
}

}  // namespace

void paged_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap,
    at::Tensor& out) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out: head_size must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache/value_cache must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1 &&
                  query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous(),
              "block_table/query_start_loc/seq_lens must be int32 with a contiguous last dim");
  Params p{};
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.out = out.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.bt_stride = block_table.stride(0);
  p.block_size = key_cache.size(1);
  p.kv_heads = key_cache.size(2);
  p.head_size = key_cache.size(3);
  p.group = query.size(1) / p.kv_heads;
  p.cache_stride_block = key_cache.stride(0);
  p.cache_stride_slot = key_cache.stride(1);
  p.scale = static_cast<float>(scale);
  p.window = sliding_window;
  p.soft_cap = static_cast<float>(soft_cap);

  const int64_t num_seqs = seq_lens.size(0), num_blocks = key_cache.size(0);
  const int64_t max_blocks = block_table.size(1);
  const int64_t tile_tokens = std::max<int64_t>(1, TILE_ROWS / p.group);
  std::vector<Item> items;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    const int64_t seq_len = p.seq_lens[seq];
    TORCH_CHECK_VALUE(q_len >= 0 && q_len <= seq_len,
                      "seq_lens: every sequence's KV length must cover its query tokens (sequence ",
                      seq, ": ", q_len, " new tokens, KV length ", seq_len, ")");
    if (q_len == 0) continue;
    const int64_t pages = (seq_len + p.block_size - 1) / p.block_size;
    TORCH_CHECK_VALUE(pages <= max_blocks, "block_table: sequence ", seq, " needs ", pages,
                      " pages, the table has ", max_blocks);
    const int32_t* row = p.block_table + seq * p.bt_stride;
    for (int64_t i = 0; i < pages; ++i) {
      TORCH_CHECK_VALUE(row[i] >= 0 && row[i] < num_blocks, "block_table: sequence ", seq,
                        " page ", i, " is block ", row[i], ", outside the cache's ", num_blocks,
                        " blocks");
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int64_t nt = std::min(tile_tokens, q_len - t0);
      const int64_t last = seq_len - q_len + t0 + nt;
      const int64_t keys = sliding_window ? std::min<int64_t>(last, sliding_window + nt) : last;
      for (int64_t h = 0; h < p.kv_heads; ++h) items.push_back({seq, h, t0, nt, keys * nt});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  switch (query.scalar_type()) {
    case at::kFloat:
      run_items<float>(p, items);
      break;
    case at::kHalf:
      run_items<c10::Half>(p, items);
      break;
    case at::kBFloat16:
      run_items<c10::BFloat16>(p, items);
      break;
    default:
      TORCH_CHECK_VALUE(false, "query: unsupported dtype ", query.scalar_type());
  }
}
