// The routed experts of a mixture-of-experts layer for a few tokens (decoding): every (token,
// chosen expert) slot runs the expert's gate/up rows, SiLU-and-mul and down rows as dot products
// over the stacked weights, and the routing-weighted results are summed per token in float32.
// The torch path's matmuls per expert (plus the gather, sort and index_add around them) cost more
// in calls than in arithmetic for a few rows each; here one call does the layer. The slots are
// grouped by expert first (a counting sort), so each weight row is read once for all the slots
// that use it. Threads split the intermediate rows (gate/up) and then the hidden rows (down), so
// no two threads write one value.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "bf16_dot.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using ember_vec::VW;
using ember_vec::vf;

constexpr int64_t ROW_BLOCK = 16;      // weight rows a thread takes at a time
constexpr int64_t GRAIN_MACS = 1 << 16;  // multiply-adds per thread below which one thread runs

// Float32 dot product of two rows of T.
template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
      acc0 = _mm512_dpbf16_ps(acc0, ember_bf16::load_bf16x32(a + i), ember_bf16::load_bf16x32(b + i));
      acc1 = _mm512_dpbf16_ps(acc1, ember_bf16::load_bf16x32(a + i + 32),
                              ember_bf16::load_bf16x32(b + i + 32));
    }
    for (; i + 32 <= n; i += 32) {
      acc0 = _mm512_dpbf16_ps(acc0, ember_bf16::load_bf16x32(a + i), ember_bf16::load_bf16x32(b + i));
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  vf acc0{}, acc1{};
  for (; i + 2 * VW <= n; i += 2 * VW) {
    acc0 += ember_vec::load_as_float(a + i) * ember_vec::load_as_float(b + i);
    acc1 += ember_vec::load_as_float(a + i + VW) * ember_vec::load_as_float(b + i + VW);
  }
  for (; i + VW <= n; i += VW) {
    acc0 += ember_vec::load_as_float(a + i) * ember_vec::load_as_float(b + i);
  }
  sum += ember_vec::hsum(acc0 + acc1);
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

int64_t grain(int64_t macs_per_unit) {
  return std::max<int64_t>(1, GRAIN_MACS / std::max<int64_t>(1, macs_per_unit));
}

template <typename T>
void run_experts(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                 const at::Tensor& topk_weights, const at::Tensor& local_ids, at::Tensor& out) {
  const int64_t tokens = hidden.size(0), size = hidden.size(1), top_k = local_ids.size(1);
  const int64_t experts = w13.size(0), inter = w2.size(2), slots = tokens * top_k;
  const T* x = hidden.data_ptr<T>();
  const T* gate_up = w13.data_ptr<T>();
  const T* down = w2.data_ptr<T>();
  const float* route = topk_weights.data_ptr<float>();
  const int64_t* ids = local_ids.data_ptr<int64_t>();
  const int64_t x_stride = hidden.stride(0);

  // Counting sort of the held slots by expert (ids outside [0, experts) are held elsewhere).
  std::vector<int64_t> start(experts + 1, 0), order;
  for (int64_t s = 0; s < slots; ++s) {
    if (ids[s] >= 0 && ids[s] < experts) ++start[ids[s] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  order.resize(start[experts]);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < slots; ++s) {
      if (ids[s] >= 0 && ids[s] < experts) order[next[ids[s]]++] = s;
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e) {
    if (start[e + 1] > start[e]) active.push_back(e);
  }
  std::vector<float> acc(tokens * size, 0.f);
  if (!active.empty()) {
    // Gate/up and SiLU-and-mul: act[position in order][i], rounded to T as the torch path rounds
    // the projections and the activation.
    std::vector<T> act(order.size() * inter);
    const int64_t blocks = (inter + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t avg_slots = std::max<int64_t>(1, order.size() / active.size());
    at::parallel_for(0, active.size() * blocks, grain(2 * ROW_BLOCK * size * avg_slots),
                     [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t e = active[unit / blocks], r0 = (unit % blocks) * ROW_BLOCK;
        const T* w = gate_up + e * 2 * inter * size;
        for (int64_t i = r0; i < std::min(inter, r0 + ROW_BLOCK); ++i) {
          const T* g_row = w + i * size;
          const T* u_row = w + (inter + i) * size;
          for (int64_t p = start[e]; p < start[e + 1]; ++p) {
            const T* xr = x + (order[p] / top_k) * x_stride;
            const float g = static_cast<float>(static_cast<T>(dot(g_row, xr, size)));
            const float u = static_cast<float>(static_cast<T>(dot(u_row, xr, size)));
            act[p * inter + i] = static_cast<T>(g / (1.f + std::exp(-g)) * u);
          }
        }
      }
    });
    // Down rows, weighted and summed into each slot's token.
    at::parallel_for(0, (size + ROW_BLOCK - 1) / ROW_BLOCK,
                     grain(ROW_BLOCK * inter * static_cast<int64_t>(order.size())),
                     [&](int64_t begin, int64_t end) {
      for (int64_t e : active) {
        const T* w = down + e * size * inter;
        for (int64_t h = begin * ROW_BLOCK; h < std::min(size, end * ROW_BLOCK); ++h) {
          for (int64_t p = start[e]; p < start[e + 1]; ++p) {
            const int64_t slot = order[p];
            acc[(slot / top_k) * size + h] += route[slot] * dot(w + h * inter, &act[p * inter], inter);
          }
        }
      }
    });
  }
  T* o = out.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < size; ++h) o[t * size + h] = static_cast<T>(acc[t * size + h]);
  }
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& topk_weights, const at::Tensor& local_ids) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1, "moe_experts: hidden [tokens, hidden]");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.dim() == 3 && w2.dim() == 3,
              "moe_experts: contiguous stacked w13 [E, 2I, H] and w2 [E, H, I] expected");
  TORCH_CHECK(w13.scalar_type() == hidden.scalar_type() && w2.scalar_type() == hidden.scalar_type(),
              "moe_experts: weights and hidden must share a dtype");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  local_ids.scalar_type() == at::kLong && local_ids.is_contiguous() &&
                  topk_weights.sizes() == local_ids.sizes() && local_ids.size(0) == hidden.size(0),
              "moe_experts: float32 topk_weights and int64 local_ids [tokens, top_k] expected");
  TORCH_CHECK(w13.size(2) == hidden.size(1) && w2.size(1) == hidden.size(1) &&
                  w13.size(1) == 2 * w2.size(2) && w13.size(0) == w2.size(0),
              "moe_experts: weight shapes do not fit");
  at::Tensor out = at::empty({hidden.size(0), hidden.size(1)}, hidden.options());
  switch (hidden.scalar_type()) {
    case at::kFloat:
      run_experts<float>(hidden, w13, w2, topk_weights, local_ids, out);
      break;
    case at::kBFloat16:
      run_experts<c10::BFloat16>(hidden, w13, w2, topk_weights, local_ids, out);
      break;
    case at::kHalf:
      run_experts<c10::Half>(hidden, w13, w2, topk_weights, local_ids, out);
      break;
    default:
      TORCH_CHECK(false, "moe_experts: float32, bfloat16 or float16 expected");
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_topk_softmax(const at::Tensor& logits, int64_t top_k,
                                                    bool renormalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "moe_topk_softmax: logits [tokens, E]");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_topk_softmax: top_k out of range");
  at::Tensor weights = at::empty({tokens, top_k}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({tokens, top_k}, logits.options().dtype(at::kLong));
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  auto route = [&](auto* base) {
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(experts);
      for (int64_t t = begin; t < end; ++t) {
        const auto* row = base + t * stride;
        float top = -INFINITY, total = 0.f;
        for (int64_t e = 0; e < experts; ++e) top = std::max(top, static_cast<float>(row[e]));
        for (int64_t e = 0; e < experts; ++e) {
          scores[e] = std::exp(static_cast<float>(row[e]) - top);
          total += scores[e];
        }
        // The top_k best in descending order (the lower id first among equal scores); a chosen
        // score is set to -1 (below every probability) so the next pass skips it.
        float chosen = 0.f;
        for (int64_t k = 0; k < top_k; ++k) {
          int64_t best = 0;
          for (int64_t e = 1; e < experts; ++e) {
            if (scores[e] > scores[best]) best = e;
          }
          const float p = scores[best] / total;
          wp[t * top_k + k] = p;
          ip[t * top_k + k] = best;
          chosen += p;
          scores[best] = -1.f;
        }
        if (renormalize) {
          for (int64_t k = 0; k < top_k; ++k) wp[t * top_k + k] /= chosen + 1e-20f;
        }
      }
    });
  };
  switch (logits.scalar_type()) {
    case at::kFloat:
      route(logits.data_ptr<float>());
      break;
    case at::kBFloat16:
      route(logits.data_ptr<c10::BFloat16>());
      break;
    case at::kHalf:
      route(logits.data_ptr<c10::Half>());
      break;
    default:
      TORCH_CHECK(false, "moe_topk_softmax: float32, bfloat16 or float16 logits expected");
  }
  return {weights, ids};
}
