// The small per-token operations of a decoder layer, each one pass over its rows instead of the
// five to thirty tensor operations (and as many temporaries) of the torch path: RMSNorm, residual
// add + RMSNorm, SiLU-and-mul, rotary embedding and the write of new keys/values into the paged
// caches. Statistics are float32; results round to the tensor dtype where the torch path rounds.
// Rows are split over torch's intra-op threads only when there is enough work to pay for it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace ember_vec;

constexpr int64_t GRAIN_ELEMENTS = 1 << 13;  // elements per thread below which one thread runs

template <typename F>
void for_rows(int64_t rows, int64_t row_elements, const F& f) {
  const int64_t grain = std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(1, row_elements));
  if (rows <= grain) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, grain, f);
  }
}

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  int64_t i = 0;
  vf acc = splat(0.f);
  for (; i + VW <= n; i += VW) {
    const vf v = load_as_float(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += f32(x[i]) * f32(x[i]);
  return sum;
}

// out = weight * T(x / rms(x)), as the torch path (and Hugging Face) round it.
template <typename T>
void norm_row(const T* x, const T* weight, int64_t n, float eps, T* out) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    const vf normed = round_as<T>(load_as_float(x + i) * inv);
    store_as(out + i, load_as_float(weight + i) * normed);
  }
  for (; i < n; ++i) {
    out[i] = static_cast<T>(f32(weight[i]) * f32(static_cast<T>(f32(x[i]) * inv)));
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, float eps,
                   at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* src = static_cast<const T*>(x.data_ptr());
  const T* w = static_cast<const T*>(weight.data_ptr());
  T* dst = static_cast<T*>(out.data_ptr());
  const int64_t xs = x.stride(0), os = out.stride(0);
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(src + r * xs, w, n, eps, dst + r * os);
  });
}

template <typename T>
void fused_add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual,
                             const at::Tensor& weight, float eps, at::Tensor& out,
                             at::Tensor& residual_out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* a = static_cast<const T*>(x.data_ptr());
  const T* b = static_cast<const T*>(residual.data_ptr());
  const T* w = static_cast<const T*>(weight.data_ptr());
  T* dst = static_cast<T*>(out.data_ptr());
  T* sum = static_cast<T*>(residual_out.data_ptr());
  const int64_t as = x.stride(0), bs = residual.stride(0), os = out.stride(0),
                ss = residual_out.stride(0);
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* s = sum + r * ss;
      const T* ar = a + r * as;
      const T* br = b + r * bs;
      int64_t i = 0;
      for (; i + VW <= n; i += VW) store_as(s + i, load_as_float(ar + i) + load_as_float(br + i));
      for (; i < n; ++i) s[i] = static_cast<T>(f32(ar[i]) + f32(br[i]));
      norm_row(s, w, n, eps, dst + r * os);
    }
  });
}

// silu(g) = g * sigmoid(g), with exp taken of -|g| only (never overflows).
inline vf silu(vf g) {
  const vf e = exp_nonpositive(g < splat(0.f) ? g : -g);
  const vf sigmoid = (g < splat(0.f) ? e : splat(1.f)) / (splat(1.f) + e);
  return g * sigmoid;
}

inline float silu(float g) {
  const float e = exp_nonpositive(g < 0.f ? g : -g);
  return g * ((g < 0.f ? e : 1.f) / (1.f + e));
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// One bfloat16 row of silu(gate) * up with AVX512-BF16's rounding instruction in place of the
// integer rounding (one instruction for six; it flushes float32 subnormals, below 1.2e-38, to
// zero), exp_minus_abs for the exponential, and a reciprocal refined by a Newton step in place of
// the division (a few float32 units off at most, far below the bfloat16 rounding that follows). Same roundings as the
// generic row: silu rounded to bfloat16, then the product.
// exp(-|x|) as exp_nonpositive takes it (2^n * e^r, |r| <= ln2/2, the same degree-6 polynomial),
// with AVX-512's rounding and scaling instructions in place of the integer conversions, the
// exponent's bit arithmetic and the underflow selects: 2^n of a very negative n scales to 0.
inline __m512 exp_minus_abs(__m512 x) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  // -|x|, kept above -100 so that an infinite x gives 0, not inf - inf
  const __m512 v = _mm512_max_ps(
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign)), _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.6931471805599453f), v);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

inline void silu_and_mul_row_bf16(const c10::BFloat16* gate, const c10::BFloat16* up,
                                  c10::BFloat16* o, int64_t d) {
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  const auto as_float = [](const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  };
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 g = as_float(gate + i);
    const __m512 e = exp_minus_abs(g);
    const __m512 denom = _mm512_add_ps(one, e);
    __m512 inv = _mm512_rcp14_ps(denom);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(denom, inv, two));
    // sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, inv, e);
    const __m512 silu = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(g, sigmoid)));
    const __m256bh product = _mm512_cvtneps_pbh(_mm512_mul_ps(silu, as_float(up + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), (__m256i)product);
  }
  for (; i < d; ++i) {
    o[i] = static_cast<c10::BFloat16>(f32(static_cast<c10::BFloat16>(silu(f32(gate[i])))) *
                                      f32(up[i]));
  }
}
#endif

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* src = static_cast<const T*>(x.data_ptr());
  T* dst = static_cast<T*>(out.data_ptr());
  const int64_t xs = x.stride(0), os = out.stride(0);
  for_rows(rows, 2 * d, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * xs;
      const T* up = gate + d;
      T* o = dst + r * os;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        silu_and_mul_row_bf16(gate, up, o, d);
        continue;
      }
#endif
      int64_t i = 0;
      for (; i + VW <= d; i += VW) {
        store_as(o + i, round_as<T>(silu(load_as_float(gate + i))) * load_as_float(up + i));
      }
      for (; i < d; ++i) {
        o[i] = static_cast<T>(f32(static_cast<T>(silu(f32(gate[i])))) * f32(up[i]));
      }
    }
  });
}

// No multiply-add contraction here: each product rounds on its own, as in the torch path and
// Hugging Face's apply_rotary_pos_emb, so float32 results match them bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

template <typename T>
void rotate_heads(const T* x, int64_t heads, int64_t head_stride, int64_t head_size,
                  const float* cos, const float* sin, int64_t rotary_dim, bool neox, T* out) {
  const int64_t half = rotary_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* src = x + h * head_stride;
    T* dst = out + h * head_size;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
      const float x1 = f32(src[i1]), x2 = f32(src[i2]);
      const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], e = x1 * sin[i];
      dst[i1] = static_cast<T>(a - b);
      dst[i2] = static_cast<T>(c + e);
    }
    for (int64_t i = rotary_dim; i < head_size; ++i) dst[i] = src[i];
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, const at::Tensor& query,
                 const std::optional<at::Tensor>& key, const at::Tensor& cache, bool neox,
                 at::Tensor& query_out, std::optional<at::Tensor>& key_out) {
  const int64_t tokens = query.size(0), head_size = query.size(2);
  const int64_t rotary_dim = cache.size(1), half = rotary_dim / 2, max_position = cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_position, "positions: position ", pos[t],
                      " of token ", t, " is outside the cos/sin cache's ", max_position);
  }
  const T* cs = static_cast<const T*>(cache.data_ptr());
  const int64_t key_heads = key ? key->size(1) : 0;
  for_rows(tokens, (query.size(1) + key_heads) * head_size, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(half), sin(half);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = cs + pos[t] * rotary_dim;
      for (int64_t i = 0; i < half; ++i) cos[i] = f32(row[i]), sin[i] = f32(row[half + i]);
      rotate_heads(static_cast<const T*>(query.data_ptr()) + t * query.stride(0), query.size(1),
                   query.stride(1), head_size, cos.data(), sin.data(), rotary_dim, neox,
                   static_cast<T*>(query_out.data_ptr()) + t * query_out.stride(0));
      if (key) {
        rotate_heads(static_cast<const T*>(key->data_ptr()) + t * key->stride(0), key->size(1),
                     key->stride(1), head_size, cos.data(), sin.data(), rotary_dim, neox,
                     static_cast<T*>(key_out->data_ptr()) + t * key_out->stride(0));
      }
    }
  });
}

#pragma GCC pop_options

template <typename F>
void dispatch(const at::Tensor& x, const char* name, const F& f) {
  switch (x.scalar_type()) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK_VALUE(false, name, ": unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: rows must be contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x, "x", [&](auto t) { rms_norm_impl<decltype(t)>(x, weight, eps, out); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.stride(1) == 1,
              "fused_add_rms_norm: rows must be contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor residual_out = at::empty(x.sizes(), x.options());
  dispatch(x, "x", [&](auto t) {
    fused_add_rms_norm_impl<decltype(t)>(x, residual, weight, eps, out, residual_out);
  });
  return {out, residual_out};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "silu_and_mul: rows must be contiguous");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch(x, "x", [&](auto t) { silu_and_mul_impl<decltype(t)>(x, out); });
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> rotary_embedding(
    const at::Tensor& positions, const at::Tensor& query, const std::optional<at::Tensor>& key,
    const at::Tensor& cos_sin_cache, bool is_neox_style) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  query.dim() == 3 && query.stride(2) == 1 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.scalar_type() == query.scalar_type() &&
                  (!key || (key->dim() == 3 && key->stride(2) == 1)),
              "rotary_embedding: unexpected layout");
  at::Tensor query_out = at::empty(query.sizes(), query.options());
  std::optional<at::Tensor> key_out;
  if (key) key_out = at::empty(key->sizes(), key->options());
  dispatch(query, "query", [&](auto t) {
    rotary_impl<decltype(t)>(positions, query, key, cos_sin_cache, is_neox_style, query_out,
                             key_out);
  });
  return {query_out, key_out};
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2) && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(),
              "reshape_and_cache: unexpected layout");
  const int64_t tokens = key.size(0), num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // all checked before any write
    TORCH_CHECK_VALUE(slots[t] < num_slots, "slot_mapping: slot ", slots[t], " >= ", num_slots,
                      " cache slots");
  }
  const int64_t bytes = row * key.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for_rows(tokens, 2 * row, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding
      std::memcpy(kc + slots[t] * bytes, k + t * ks, bytes);
      std::memcpy(vc + slots[t] * bytes, v + t * vs, bytes);
    }
  });
}
