// Conversions and a vectorizable exp shared by the CPU ops (asyncengine/worker/cpu_ops.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace asyncengine_cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of a float
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float -> T, rounding to nearest even as torch does; branch-free for bf16 so loops vectorize
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : rounded),
                       c10::BFloat16::from_bits());
}

// x rounded to T and back: where eager torch would store an intermediate in T
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// n elements of a row as float32
template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

// exp(x) as 2^(x log2 e): 2^round(.) from the exponent bits, 2^fraction (in [-0.5, 0.5]) from a
// degree-6 polynomial; x clamped to [-87, 88]; relative error ~1e-7. It vectorizes, where
// std::exp (and std::floor, in GCC 12) do not, and would cost more than the rest of a loop.
inline float fast_exp(float x) {
  const float t = std::min(std::max(x, -87.0f), 88.0f) * 1.4426950408889634f;
  const float whole = std::rint(t), f = t - whole;
  float p = 1.5465312390e-04f;
  p = p * f + 1.3395279800e-03f;
  p = p * f + 9.6180399456e-03f;
  p = p * f + 5.5503406807e-02f;
  p = p * f + 2.4022651101e-01f;
  p = p * f + 6.9314720006e-01f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(whole) * (1 << 23);  // times 2^whole
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

#if defined(__AVX512F__)
// fast_exp of 16 lanes: the same clamp and polynomial, with 2^whole applied by vscalefps (one
// instruction for the conversion, shift and add of the scalar version)
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(
      _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)),
      _mm512_set1_ps(1.4426950408889634f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.5465312390e-04f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3395279800e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180399456e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406807e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651101e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314720006e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, whole);
}
#endif

// A softmax's numerators in place: s[j] = exp(s[j] - max) over [a, b), in two passes (the max,
// then the exps and their sum); returns 1 / their sum, the normalizer.
inline float exp_in_place(float* __restrict s, int64_t a, int64_t b) {
#if defined(__AVX512F__)
  const int64_t n = b - a;
  float* row = s + a;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = neg_inf;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
  vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, tail, row + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
    _mm512_storeu_ps(row + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (tail != 0) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + j), m));
    _mm512_mask_storeu_ps(row + j, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
  }
  return 1.f / _mm512_reduce_add_ps(vsum);
#else
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = a; j < b; ++j) m = std::max(m, s[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = a; j < b; ++j) {
    s[j] = fast_exp(s[j] - m);
    sum += s[j];
  }
  return 1.f / sum;
#endif
}

#if defined(__AVX512F__)
// 16 elements of a row as float32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// 16 bf16 values (their bits) as float32: bf16 is the top half of a float
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

}  // namespace asyncengine_cpu
