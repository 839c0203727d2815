// Reading a row's live slots, shared by the policies' C++ selection (select_cpu.cpp) and
// state updates (state_cpu.cpp). A slot is live from its position (int64, -1 = none) or
// from a live mask (bool, 1 byte a slot: 8x less to read than the positions, which a
// step's other passes have long pushed out of cache by the time a policy selects).
//
// Included by both sources; ninja's header dependencies rebuild both when it changes.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace live_slots {

// A view's rows as [N, W], or as [L, R, W] with row l·R + r at [l, r]: the tables' own
// slice (positions, a policy's state), read in place where the view hands it so, with
// no [N, W] copy first. Any strides but a unit one along W (else a contiguous copy,
// kept alive here). Row i starts at data + (i / rr) * s0 + (i % rr) * s1.
template <typename T>
struct Rows {
  at::Tensor t;
  const T* data;
  int64_t n, w, rr, s0, s1;
  const T* row(int64_t i) const { return data + (i / rr) * s0 + (i % rr) * s1; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& x, const char* what) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.scalar_type() == c10::CppTypeToScalarType<T>::value,
              what, " must be [N, W] or [L, R, W] ", c10::CppTypeToScalarType<T>::value);
  at::Tensor c = x.stride(-1) == 1 ? x : x.contiguous();
  const bool layered = c.dim() == 3;
  const int64_t rr = layered ? c.size(1) : 1;
  const int64_t s0 = c.stride(0), s1 = layered ? c.stride(1) : 0;
  const T* data = c.data_ptr<T>();
  return {std::move(c), data, layered ? x.size(0) * rr : x.size(0), x.size(-1), rr, s0, s1};
}

inline bool alive(const int64_t* p, int64_t j) { return p[j] >= 0; }
inline bool alive(const bool* p, int64_t j) { return p[j]; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_LIVE16 1
// The 16 live flags of slots j..j+15 as a mask.
inline __mmask16 live16(const int64_t* p, int64_t j) {
  const __m512i zero = _mm512_setzero_si512();
  const __mmask8 lo = _mm512_cmpge_epi64_mask(_mm512_loadu_si512(p + j), zero);
  const __mmask8 hi = _mm512_cmpge_epi64_mask(_mm512_loadu_si512(p + j + 8), zero);
  return static_cast<__mmask16>(lo | (static_cast<unsigned>(hi) << 8));
}
inline __mmask16 live16(const bool* p, int64_t j) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j));
  return _mm_test_epi8_mask(x, x);
}
#elif defined(__AVX2__)
#define KVSERVE_LIVE8 1
// The 8 live flags of slots j..j+7 as float lanes (all ones: live), for CPUs with AVX2
// but no AVX-512 (AMD Zen 1-3), which ran the scalar loops before.
inline __m256 live8(const int64_t* p, int64_t j) {
  const __m256i none = _mm256_set1_epi64x(-1);
  const __m256i lo = _mm256_cmpgt_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j)), none);
  const __m256i hi = _mm256_cmpgt_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j + 4)), none);
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);  // each 64-bit lane's low half
  return _mm256_castsi256_ps(_mm256_set_m128i(
      _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(hi, even)),
      _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(lo, even))));
}
inline __m256 live8(const bool* p, int64_t j) {
  int64_t chunk;
  std::memcpy(&chunk, p + j, sizeof chunk);
  const __m256i x = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(chunk));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(x, _mm256_setzero_si256()));
}
#endif

// The lowest score among the live slots of [a, b) (+inf if none; a NaN never wins).
// With AVX-512, 16 running minima in one register (8 with AVX2) (`<` ordered, as the scalar loop's
// compare): GCC leaves the scalar form a branch per slot, since a select between a
// loaded score and +inf is a load it will not hoist. A minimum does not depend on the
// order (0 and -0 may swap, which `==` cannot tell apart), so it is the scalar value.
template <typename P>
inline float lowest(const float* s, const P* pos, int64_t a, int64_t b) {
  float lo = INFINITY;
  int64_t j = a;
#ifdef KVSERVE_LIVE16
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 m = inf;
  for (; j + 16 <= b; j += 16) {
    const __m512 v = _mm512_mask_blend_ps(live16(pos, j), inf, _mm512_loadu_ps(s + j));
    m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, m, _CMP_LT_OQ), m, v);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, m);
  for (float x : lanes) lo = x < lo ? x : lo;
#elif defined(KVSERVE_LIVE8)  // the same, 8 running minima
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 m = inf;
  for (; j + 8 <= b; j += 8) {
    const __m256 v = _mm256_blendv_ps(inf, _mm256_loadu_ps(s + j), live8(pos, j));
    m = _mm256_blendv_ps(m, v, _mm256_cmp_ps(v, m, _CMP_LT_OQ));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float x : lanes) lo = x < lo ? x : lo;
#endif
  for (; j < b; ++j) {
    const float v = alive(pos, j) ? s[j] : INFINITY;
    lo = v < lo ? v : lo;
  }
  return lo;
}

// Live slots in [a, b), 16 (AVX-512) or 8 (AVX2) at a time.
template <typename P>
inline int64_t count_live(const P* pos, int64_t a, int64_t b) {
  int64_t n = 0, j = a;
#ifdef KVSERVE_LIVE16
  for (; j + 16 <= b; j += 16) n += __builtin_popcount(static_cast<unsigned>(live16(pos, j)));
#elif defined(KVSERVE_LIVE8)
  for (; j + 8 <= b; j += 8) n += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(live8(pos, j))));
#endif
  for (; j < b; ++j) n += alive(pos, j);
  return n;
}

// The slot just past the k-th live slot of [a, b) (k >= 1; b if it has fewer), found
// walking forward a block of flags at a time.
template <typename P>
inline int64_t past_kth_live(const P* pos, int64_t a, int64_t b, int64_t k) {
  int64_t j = a;
#ifdef KVSERVE_LIVE16
  for (; j + 16 <= b; j += 16) {
    const int64_t c = __builtin_popcount(static_cast<unsigned>(live16(pos, j)));
    if (c >= k) break;
    k -= c;
  }
#elif defined(KVSERVE_LIVE8)
  for (; j + 8 <= b; j += 8) {
    const int64_t c = __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(live8(pos, j))));
    if (c >= k) break;
    k -= c;
  }
#endif
  for (; j < b; ++j)
    if (alive(pos, j) && --k == 0) return j + 1;
  return b;
}

// The candidates [a, b) of a row of w slots: past its first `first` live slots and
// before its last `last` ones (b <= a: none). Both edges are found walking forward: a
// walk back from the row's end (the recent window) read a cache line per eight
// positions against the prefetcher, each a miss after the forward, and cost H2O's
// 32-token window ~0.4 us a row, most of its selection.
template <typename P>
inline std::pair<int64_t, int64_t> candidates(const P* pos, int64_t w, int64_t first, int64_t last) {
  const int64_t a = first > 0 ? past_kth_live(pos, 0, w, first) : 0;
  if (last <= 0) return {a, w};
  const int64_t n = count_live(pos, a, w);
  if (n <= last) return {a, a};
  return {a, past_kth_live(pos, a, w, n - last)};
}

}  // namespace live_slots
