// Paged attention's prefill layout (see paged_attention.cpp): tiles with at least one vector of
// rows keep their queries, probabilities and output transposed, so that every inner loop is a
// broadcast-multiply-add over a vector of rows.
#pragma once

#include "paged_attention_common.h"

#include <algorithm>
#include <cstdint>

namespace ember_paged {

// Prefill layout: rows on the vector lanes. q: [D][Mp], s: [CHUNK][Mp], o: [D][Mp].
template <typename T>
void attend_columns(const Params& p, const Item& it, Scratch& w) {
  const int64_t D = p.head_size, G = p.group;
  // Rows padded to a multiple of two vectors (the micro-kernels' width).
  const int64_t M = it.num_tokens * G, Mp = (M + 2 * VW - 1) / (2 * VW) * (2 * VW);
  const int64_t seq_len = p.seq_lens[it.seq];
  const int64_t q_len = p.query_start_loc[it.seq + 1] - p.query_start_loc[it.seq];
  const int64_t first_pos = seq_len - q_len + it.first_token;
  const int64_t last_pos = first_pos + it.num_tokens - 1;
  const int32_t* blocks = p.block_table + it.seq * p.bt_stride;
  const T* query = static_cast<const T*>(p.query);

  w.q.resize(D * Mp);
  w.s.resize(CHUNK * Mp);
  w.o.assign(D * Mp, 0.f);
  w.m.assign(Mp, NEG_INF);
  w.l.assign(Mp, 0.f);
  w.pos.resize(Mp);
  w.krows.resize(CHUNK);
  w.vrows.resize(CHUNK);
  if constexpr (!std::is_same_v<T, float>) {
    w.kconv.resize(CHUNK * D);
    w.vconv.resize(CHUNK * D);
  }
  // Row r is token r / G, head r % G of the group; pad rows repeat the last real row.
  for (int64_t r = 0; r < Mp; ++r) {
    const int64_t rr = std::min(r, M - 1), t = rr / G, h = it.kv_head * G + rr % G;
    const T* src = query + (p.query_start_loc[it.seq] + it.first_token + t) * p.q_stride_token +
                   h * p.q_stride_head;
    for (int64_t d = 0; d < D; ++d) w.q[d * Mp + r] = to_float(src[d]) * p.scale;
    w.pos[r] = static_cast<float>(first_pos + t);
  }
  const int64_t k_begin = p.window ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  float* q = w.q.data();
  float* s = w.s.data();
  float* o = w.o.data();
  for (int64_t k0 = k_begin; k0 <= last_pos; k0 += CHUNK) {
    const int64_t n = std::min(CHUNK, last_pos + 1 - k0);
    chunk_rows<T>(p, static_cast<const T*>(p.key_cache), blocks, it.kv_head, k0, n, w.kconv,
                  w.krows.data());
    chunk_rows<T>(p, static_cast<const T*>(p.value_cache), blocks, it.kv_head, k0, n, w.vconv,
                  w.vrows.data());
    const float* const* kr = w.krows.data();
    const float* const* vr = w.vrows.data();
    // Scores s[j][r] = q_r . k_j: eight keys by two row vectors (16 accumulators) at a time; a
    // tail block repeats its last key and drops those results.
    for (int64_t j = 0; j < n; j += 8) {
      const int64_t nj = std::min<int64_t>(8, n - j);
      const float* k[8];
      for (int i = 0; i < 8; ++i) k[i] = kr[j + std::min<int64_t>(i, nj - 1)];
      for (int64_t mb = 0; mb < Mp; mb += 2 * VW) {
        vf a[8][2] = {};
        for (int64_t d = 0; d < D; ++d) {
          const vf q0 = load(q + d * Mp + mb), q1 = load(q + d * Mp + mb + VW);
          for (int i = 0; i < 8; ++i) {
            const float kd = k[i][d];
            a[i][0] += q0 * kd;
            a[i][1] += q1 * kd;
          }
        }
        for (int64_t i = 0; i < nj; ++i) {
          store(s + (j + i) * Mp + mb, a[i][0]);
          store(s + (j + i) * Mp + mb + VW, a[i][1]);
        }
      }
    }
    if (p.soft_cap > 0.f) soft_cap_scores(s, n * Mp, p.soft_cap);
    // Mask keys past a row's position (the diagonal) or before its window.
    const bool diagonal = k0 + n - 1 > first_pos;
    const bool window_edge = p.window && k0 <= last_pos - p.window;
    if (diagonal || window_edge) {
      for (int64_t mb = 0; mb < Mp; mb += VW) {
        const vf pos = load(w.pos.data() + mb);
        for (int64_t j = 0; j < n; ++j) {
          const float key = static_cast<float>(k0 + j);
          vi hidden = splat(key) > pos;
          if (p.window) hidden |= splat(key) <= pos - static_cast<float>(p.window);
          store(s + j * Mp + mb, hidden ? splat(NEG_INF) : load(s + j * Mp + mb));
        }
      }
    }
    // Online softmax per row, vectorized over rows.
    for (int64_t mb = 0; mb < Mp; mb += VW) {
      vf mx = load(w.m.data() + mb);
      for (int64_t j = 0; j < n; ++j) mx = vmax(mx, load(s + j * Mp + mb));
      const vf m_old = load(w.m.data() + mb);
      // A row that has seen only masked keys so far keeps weight 0 (no inf - inf).
      const vf m_use = mx == splat(NEG_INF) ? splat(0.f) : mx;
      const vf alpha = exp_nonpositive(m_old - m_use);
      vf sum = splat(0.f);
      for (int64_t j = 0; j < n; ++j) {
        const vf e = exp_nonpositive(load(s + j * Mp + mb) - m_use);
        store(s + j * Mp + mb, e);
        sum += e;
      }
      store(w.l.data() + mb, load(w.l.data() + mb) * alpha + sum);
      store(w.m.data() + mb, mx);
      for (int64_t d = 0; d < D; ++d) store(o + d * Mp + mb, load(o + d * Mp + mb) * alpha);
    }
    // o[d][r] += sum_j v_j[d] * s[j][r]: eight head dims by two row vectors at a time; a tail
    // block repeats its last dim and drops those results.
    for (int64_t d = 0; d < D; d += 8) {
      const int64_t nd = std::min<int64_t>(8, D - d);
      int64_t dd[8];
      for (int i = 0; i < 8; ++i) dd[i] = d + std::min<int64_t>(i, nd - 1);
      for (int64_t mb = 0; mb < Mp; mb += 2 * VW) {
        vf a[8][2];
        for (int i = 0; i < 8; ++i) {
          a[i][0] = load(o + dd[i] * Mp + mb);
          a[i][1] = load(o + dd[i] * Mp + mb + VW);
        }
        for (int64_t j = 0; j < n; ++j) {
          const vf p0 = load(s + j * Mp + mb), p1 = load(s + j * Mp + mb + VW);
          const float* v = vr[j];
          for (int i = 0; i < 8; ++i) {
            const float vd = v[dd[i]];
            a[i][0] += p0 * vd;
            a[i][1] += p1 * vd;
          }
        }
        for (int64_t i = 0; i < nd; ++i) {
          store(o + (d + i) * Mp + mb, a[i][0]);
          store(o + (d + i) * Mp + mb + VW, a[i][1]);
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
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d * Mp + r] * inv);
  }
}

}  // namespace ember_paged
