// Vectors of floats for the CPU kernels: GCC vector extensions of the widest width the build
// target has (the build is per CPU: see build.py), with lane reductions, exp, and loads and stores
// of float16/bfloat16 rows converted to and from float vectors (the arithmetic is float32).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ember_vec {

#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) { return vf{} + x; }
// Sum of the lanes by halving (a serial lane loop is a long dependency chain).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
  return v[0];
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// Largest lane, by halving as hsum.
inline float hmax(vf v) {
#if defined(__AVX512F__)
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return v[0];
}

// exp(x) for x <= 0: 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (relative error
// about 1e-7); exactly 0 below -87 (and for -inf, the masked scores).
inline vf exp_nonpositive(vf x) {
  vi underflow = x < splat(-87.f);
  x = underflow ? splat(-87.f) : x;
  x = x > splat(0.f) ? splat(0.f) : x;
  vf t = x * 1.4426950408889634f;
  vi n = __builtin_convertvector(t - 0.5f, vi);  // round half down (t <= 0 truncates up)
  vf r = (t - __builtin_convertvector(n, vf)) * 0.6931471805599453f;
  vf p = splat(1.f / 720);
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(vf));
  vf e = p * scale;
  return underflow ? splat(0.f) : e;
}

inline float exp_nonpositive(float x) {
  vf v = exp_nonpositive(splat(x));
  return v[0];
}

typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(float))));

inline vf bits_to_float(vu bits) {
  vf v;
  std::memcpy(&v, &bits, sizeof(vf));
  return v;
}

inline vu float_to_bits(vf v) {
  vu bits;
  std::memcpy(&bits, &v, sizeof(vf));
  return bits;
}

// The bfloat16 bits of each lane, rounded to nearest even as c10::BFloat16 rounds (a NaN becomes
// the quiet NaN 0x7fc0), in the high half of each 32-bit lane.
inline vu bf16_round_bits(vf v) {
  const vu bits = float_to_bits(v);
  const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  return (v != v) ? vu{} + 0x7fc00000u : rounded;
}

// VW values of T at p as floats (T: float, c10::Half, c10::BFloat16).
template <typename T>
inline vf load_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vh h;
    std::memcpy(&h, p, sizeof(vh));
    return bits_to_float(__builtin_convertvector(h, vu) << 16);
  } else {
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    vf out;
    std::memcpy(&out, &v, sizeof(vf));
    return out;
#elif defined(__F16C__)
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    vf out;
    std::memcpy(&out, &v, sizeof(vf));
    return out;
#else
    vf out;
    for (int i = 0; i < VW; ++i) out[i] = static_cast<float>(p[i]);
    return out;
#endif
  }
}

#if defined(__AVX512F__)
// load_as_float as an AVX-512 register, for kernels written in intrinsics.
template <typename T>
inline __m512 load_as_m512(const T* p) {
  const vf v = load_as_float(p);
  __m512 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}
#endif

// VW floats stored at p as T, each rounded as static_cast<T> rounds it.
template <typename T>
inline void store_as(T* p, vf v) {
  if constexpr (std::is_same_v<T, float>) {
    store(p, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const vh h = __builtin_convertvector(bf16_round_bits(v) >> 16, vh);
    std::memcpy(p, &h, sizeof(vh));
  } else {
#if defined(__AVX512F__)
    __m512 x;
    std::memcpy(&x, &v, sizeof(vf));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    __m256 x;
    std::memcpy(&x, &v, sizeof(vf));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < VW; ++i) p[i] = static_cast<T>(v[i]);
#endif
  }
}

// Each lane rounded to T and back (the torch path's intermediate roundings, vectorized).
template <typename T>
inline vf round_as(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bits_to_float(bf16_round_bits(v));
  } else {
    T tmp[VW];
    store_as(tmp, v);
    return load_as_float(tmp);
  }
}

}  // namespace ember_vec
