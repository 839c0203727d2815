// Pyramid's window ring and its exact total (policies/pyramid.py::_shift_window): the
// fixed-point arithmetic of one slot, shared by the policy's op (state_cpu.cpp, which
// updates a step's rows after the forward) and the CPU decode kernel
// (attention/csrc/paged_decode_cpu.cpp, which updates each row as it writes its mass), so
// both leave the same bits.
//
// A query's mass m (>= 0) counts as round(m · 2^shift), an integer; a slot's total is
// the sum of its ring's integers in int64, kept as three float32 digits of 21 bits
// (exact in float32: the state is float32), low digit first, the top one keeping the
// sign. A column's old value leaves the total as the same integer it entered as, so the
// total is the window's whatever the history.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define WINDOW_RING_AVX512 1
#define WINDOW_RING_LANES8 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define WINDOW_RING_AVX2 1
#define WINDOW_RING_LANES8 1
#endif

namespace window_ring {

constexpr int kDigit = 21;
constexpr int64_t kDigitMask = (int64_t{1} << kDigit) - 1;

// round(x · up), halves to even (the torch form's torch.round of the double product).
inline int64_t fixed(float x, double up) { return std::llrint(static_cast<double>(x) * up); }

// The total whose digits are d0, d0 + t3, d0 + 2 t3.
inline int64_t load(const float* d0, int64_t t3) {
  return static_cast<int64_t>(d0[0]) + (static_cast<int64_t>(d0[t3]) << kDigit) +
         static_cast<int64_t>(d0[2 * t3]) * (int64_t{1} << (2 * kDigit));
}

inline void store(float* d0, int64_t t3, int64_t sum) {
  d0[0] = static_cast<float>(sum & kDigitMask);
  d0[t3] = static_cast<float>((sum >> kDigit) & kDigitMask);
  d0[2 * t3] = static_cast<float>(sum >> (2 * kDigit));
}

// One slot's step: its ring column `col` (one value) becomes m, its total follows.
inline void put(float* col, float* total, int64_t t3, float m, double up) {
  store(total, t3, load(total, t3) + fixed(m, up) - fixed(*col, up));
  *col = m;
}

#ifdef WINDOW_RING_AVX512
// The same for 8 consecutive slots (unit slot strides: the tables' column layout), the
// same integer arithmetic, so the same bits: float -> double is exact, the double ->
// int64 conversion rounds to nearest even as llrint does, the digits are integers.
// Scalar, the two llrint calls a slot and the int64 sum through three float digits
// were ~5 ns a slot, most of pyramid's step.
using Sum8 = __m512i;  // 8 totals
inline __m512d splat(double up) { return _mm512_set1_pd(up); }

inline __m512i load8(const float* d0, int64_t t3) {
  const __m512i v = _mm512_add_epi64(
      _mm512_cvttps_epi64(_mm256_loadu_ps(d0)),
      _mm512_slli_epi64(_mm512_cvttps_epi64(_mm256_loadu_ps(d0 + t3)), kDigit));
  return _mm512_add_epi64(v, _mm512_slli_epi64(_mm512_cvttps_epi64(_mm256_loadu_ps(d0 + 2 * t3)),
                                               2 * kDigit));
}

inline void store8(float* d0, int64_t t3, __m512i v) {
  const __m512i digit = _mm512_set1_epi64(kDigitMask);
  _mm256_storeu_ps(d0, _mm512_cvtepi64_ps(_mm512_and_si512(v, digit)));
  _mm256_storeu_ps(d0 + t3, _mm512_cvtepi64_ps(_mm512_and_si512(_mm512_srai_epi64(v, kDigit), digit)));
  _mm256_storeu_ps(d0 + 2 * t3, _mm512_cvtepi64_ps(_mm512_srai_epi64(v, 2 * kDigit)));
}

inline __m512i fixed8(__m256 x, __m512d up) {
  return _mm512_cvtpd_epi64(_mm512_mul_pd(_mm512_cvtps_pd(x), up));
}

// v (8 totals) after column `col` becomes `mass` there.
inline __m512i put8(float* col, const float* mass, __m512i v, __m512d up) {
  const __m256 m = _mm256_loadu_ps(mass);
  v = _mm512_add_epi64(v, _mm512_sub_epi64(fixed8(m, up), fixed8(_mm256_loadu_ps(col), up)));
  _mm256_storeu_ps(col, m);
  return v;
}
#elif defined(WINDOW_RING_AVX2)
// The same 8-lane forms with AVX2 (CPUs without AVX-512), which converts no int64 to or
// from floating point and shifts no int64 arithmetically: the same integers by other
// means, so the same bits. 8 totals are two vectors of 4 int64.
struct Sum8 {
  __m256i lo, hi;  // slots 0-3, 4-7
};
inline __m256d splat(double up) { return _mm256_set1_pd(up); }

// 4 digits (integral float32, below 2^21 in magnitude) as int64.
inline __m256i digits4(const float* d) {
  return _mm256_cvtepi32_epi64(_mm_cvttps_epi32(_mm_loadu_ps(d)));
}

inline __m256i load4(const float* d0, int64_t t3) {
  return _mm256_add_epi64(
      _mm256_add_epi64(digits4(d0), _mm256_slli_epi64(digits4(d0 + t3), kDigit)),
      _mm256_slli_epi64(digits4(d0 + 2 * t3), 2 * kDigit));
}

inline Sum8 load8(const float* d0, int64_t t3) { return {load4(d0, t3), load4(d0 + 4, t3)}; }

// The 8 totals into dst (state_cpu.cpp converts them to float one by one: AVX2 has no
// int64 -> float conversion; AVX-512's is exact in a vector).
inline void store_sums(int64_t* dst, Sum8 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 4), v.hi);
}

// The low 32 bits of 8 int64 as float32 (exact: each a digit, below 2^21 in magnitude).
inline __m256 low_as_float(__m256i lo, __m256i hi) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  return _mm256_cvtepi32_ps(_mm256_permute2x128_si256(
      _mm256_permutevar8x32_epi32(lo, even), _mm256_permutevar8x32_epi32(hi, even), 0x20));
}

// v >> s on int64, arithmetic (copies of the sign shifted in), as the scalar >>.
template <int S>
inline __m256i sra(__m256i v) {
  const __m256i sign = _mm256_cmpgt_epi64(_mm256_setzero_si256(), v);
  return _mm256_or_si256(_mm256_srli_epi64(v, S), _mm256_slli_epi64(sign, 64 - S));
}

inline void store8(float* d0, int64_t t3, Sum8 v) {
  const __m256i digit = _mm256_set1_epi64x(kDigitMask);
  _mm256_storeu_ps(d0, low_as_float(_mm256_and_si256(v.lo, digit), _mm256_and_si256(v.hi, digit)));
  _mm256_storeu_ps(d0 + t3, low_as_float(_mm256_and_si256(_mm256_srli_epi64(v.lo, kDigit), digit),
                                         _mm256_and_si256(_mm256_srli_epi64(v.hi, kDigit), digit)));
  _mm256_storeu_ps(d0 + 2 * t3, low_as_float(sra<2 * kDigit>(v.lo), sra<2 * kDigit>(v.hi)));
}

// round(double(x) · up) for 4 masses x >= 0 (products below 2^63), halves to even as
// llrint in the default rounding mode: below 2^52, adding 2^52 leaves the rounded
// integer in the mantissa's bits; from 2^52 the product is an integer already, its
// mantissa shifted left by its exponent.
inline __m256i fixed4(__m128 x, __m256d up) {
  const __m256d d = _mm256_mul_pd(_mm256_cvtps_pd(x), up);
  const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
  const __m256i small = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(d, two52)),
                                         _mm256_castpd_si256(two52));
  const __m256i bits = _mm256_castpd_si256(d);
  const __m256i mant = _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi64x((int64_t{1} << 52) - 1)),
                                       _mm256_set1_epi64x(int64_t{1} << 52));
  const __m256i big = _mm256_sllv_epi64(
      mant, _mm256_sub_epi64(_mm256_srli_epi64(bits, 52), _mm256_set1_epi64x(1075)));
  return _mm256_castpd_si256(_mm256_blendv_pd(_mm256_castsi256_pd(big), _mm256_castsi256_pd(small),
                                              _mm256_cmp_pd(d, two52, _CMP_LT_OQ)));
}

inline Sum8 put8(float* col, const float* mass, Sum8 v, __m256d up) {
  const __m128 m0 = _mm_loadu_ps(mass), m1 = _mm_loadu_ps(mass + 4);
  v.lo = _mm256_add_epi64(v.lo, _mm256_sub_epi64(fixed4(m0, up), fixed4(_mm_loadu_ps(col), up)));
  v.hi = _mm256_add_epi64(v.hi, _mm256_sub_epi64(fixed4(m1, up), fixed4(_mm_loadu_ps(col + 4), up)));
  _mm_storeu_ps(col, m0);
  _mm_storeu_ps(col + 4, m1);
  return v;
}
#endif

// Slots [0, w) of a row at once: its ring column `col` becomes `mass`, the totals follow.
inline void put_row(float* col, float* total, int64_t t3, const float* mass, int64_t w, double up) {
  int64_t s = 0;
#ifdef WINDOW_RING_LANES8
  const auto upv = splat(up);
  for (; s + 8 <= w; s += 8)
    store8(total + s, t3, put8(col + s, mass + s, load8(total + s, t3), upv));
#endif
  for (; s < w; ++s) put(col + s, total + s, t3, mass[s], up);
}

}  // namespace window_ring
