// Vectors of floats for the CPU kernels: GCC vector extensions of the widest width the build
// target has (the build is per CPU: see build.py), with lane reductions and exp.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace ember_vec
