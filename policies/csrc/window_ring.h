// Pyramid's window ring and its exact total (policies/pyramid.py::_shift_window): the
// fixed-point arithmetic of one slot, shared by the policy's op (state_cpu.cpp, which
// updates a step's rows after the forward) and the CPU decode kernel
// (kvpool/csrc/paged_decode_cpu.cpp, which updates each row as it writes its mass), so
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

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define WINDOW_RING_AVX512 1
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
#endif

// Slots [0, w) of a row at once: its ring column `col` becomes `mass`, the totals follow.
inline void put_row(float* col, float* total, int64_t t3, const float* mass, int64_t w, double up) {
  int64_t s = 0;
#ifdef WINDOW_RING_AVX512
  const __m512d upv = _mm512_set1_pd(up);
  for (; s + 8 <= w; s += 8)
    store8(total + s, t3, put8(col + s, mass + s, load8(total + s, t3), upv));
#endif
  for (; s < w; ++s) put(col + s, total + s, t3, mass[s], up);
}

}  // namespace window_ring
