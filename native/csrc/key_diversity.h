// KeyDiff's key diversity over a listed set of live key rows, shared by the pool's op
// (key_stats_cpu.cpp: rows of blocks, after the step) and the decode kernel
// (paged_decode_cpu.cpp: each sequence's visible rows, right after its attention, while
// its keys are still in cache). One code path, so both give the same bits.
//
// Maths as policies/norms.py::keydiff_scores (fp32): u = k / max(|k|, 1e-12)
// (F.normalize), anchor_h = mean over the listed slots of u_h, divided by
// max(|anchor_h|, 1e-8); score = -mean over kv heads of u_h . anchor_h.
//
// Included by both sources; ninja's header dependencies rebuild both when it changes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVSERVE_KEYDIFF_AVX512 1
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_KEYDIFF_LANES8 1  // 8-lane helpers (the decode kernel's AVX2 path's too)
#include <immintrin.h>
#ifndef KVSERVE_KEYDIFF_AVX512
#define KVSERVE_KEYDIFF_AVX2 1  // this file's 8-lane tiles
#endif
#endif

namespace keydiff {

#ifdef KVSERVE_KEYDIFF_AVX512
// 16 lanes of bf16 or fp16 widened to fp32 (bf16 is the top half of an fp32: a shift).
template <typename T>
inline __m512 widen16(__m256i h) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else
    return _mm512_cvtph_ps(h);
}

// 16 elements of T (fp32, bf16, fp16) widened to fp32.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return _mm512_loadu_ps(p);
  else
    return widen16<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#ifdef KVSERVE_KEYDIFF_LANES8
// 8 elements of T (fp32, bf16, fp16) widened to fp32.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>)  // bf16 is the top half of an fp32
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      return _mm256_cvtph_ps(h);
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Lane s of the result = the sum of v[s]'s 8 lanes.
inline __m256 sum8x8(const __m256* v) {
  // hadd(a, b) = [a01 a23 b01 b23 | a45 a67 b45 b67]; two levels leave [v0..v3 low
  // halves' sums | v0..v3 high halves'] and the same for v4..v7
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

// Compiled without -ffast-math wherever this header is included (the decode kernel's
// source has it), so both users give the same bits: a division turned into a
// reciprocal's product, or a reassociated sum, would round the anchor and the scores
// apart. The AVX-512 per-slot loops are outside this region: compiled with the
// includer's flags they give the same bits (tests/test_key_stats.py checks it, in the
// decode kernel too) and run ~1.7x faster than inside it.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
// A key row of n values as fp32: the pool's own memory for an fp32 pool, else widened
// into `buf` (exact: bf16 is the top half of an fp32, fp16 converts exactly).
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int64_t x = 0;
#ifdef KVSERVE_KEYDIFF_AVX512
    if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
      for (; x + 16 <= n; x += 16) _mm512_storeu_ps(buf + x, load16(src + x));
    }
#elif defined(KVSERVE_KEYDIFF_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>)
      for (; x + 8 <= n; x += 8) _mm256_storeu_ps(buf + x, load8(src + x));
#endif
    for (; x < n; ++x) buf[x] = static_cast<float>(src[x]);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t x = 0;
  float s = 0.f;
#ifdef KVSERVE_KEYDIFF_AVX512
  if (n >= 16) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (x = 16; x + 16 <= n; x += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + x), _mm512_loadu_ps(b + x), acc);
    s = _mm512_reduce_add_ps(acc);
  }
#elif defined(KVSERVE_KEYDIFF_AVX2)
  if (n >= 8) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (x = 8; x + 8 <= n; x += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + x), _mm256_loadu_ps(b + x), acc);
    s = hsum8(acc);
  }
#endif
  for (; x < n; ++x) s += a[x] * b[x];
  return s;
}

inline void axpy(float c, const float* x, float* y, int64_t n) {  // y += c * x
  int64_t i = 0;
#ifdef KVSERVE_KEYDIFF_AVX512
  const __m512 cv = _mm512_set1_ps(c);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(cv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(KVSERVE_KEYDIFF_AVX2)
  const __m256 cv = _mm256_set1_ps(c);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(cv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += c * x[i];
}

// The anchors' sums over `count` live slots -> their means, each divided by its norm
// clamped at 1e-8 (keydiff_scores' clamp). Once per row: out of line (below).
__attribute__((noinline)) inline void normalise_anchor(float* anchor, int64_t H, int64_t D,
                                                       int64_t count) {
  for (int64_t h = 0; h < H; ++h) {
    float* ah = anchor + h * D;
    for (int64_t x = 0; x < D; ++x) ah[x] /= static_cast<float>(count);
    const float c = 1.f / std::max(std::sqrt(dot(ah, ah, D)), 1e-8f);
    for (int64_t x = 0; x < D; ++x) ah[x] *= c;
  }
}

// Per thread, reused across rows: `rows` and `logical` list a row's live key rows (each
// the start of its Hkv * D values) and their slots; the caller fills them.
struct Scratch {
  std::vector<float> inv, anchor, buf;
  std::vector<const void*> rows;
  std::vector<int64_t> logical;
  Scratch(int64_t slots, int64_t H, int64_t D)
      : inv((slots + 15) / 16 * 16 * H), anchor(H * D), buf(H * D), rows((slots + 15) / 16 * 16),
        logical((slots + 15) / 16 * 16) {}
};

// The portable form (any head dim): pass 1 sums the unit keys (their inverse norms kept
// per slot and head), pass 2 takes each unit key's dot with its head's normalised anchor.
template <typename T>
void score_listed_portable(int64_t n, int64_t H, int64_t D, float* out, Scratch& s) {
  const int64_t HD = H * D;
  const T* const* rows = reinterpret_cast<const T* const*>(s.rows.data());
  const int64_t* logical = s.logical.data();
  std::fill(s.anchor.begin(), s.anchor.end(), 0.f);
  float* inv = s.inv.data();
  float* anchor = s.anchor.data();
  float* buf = s.buf.data();
  for (int64_t i = 0; i < n; ++i) {
    const float* k = as_float(rows[i], buf, HD);
    for (int64_t h = 0; h < H; ++h) {
      const float* kh = k + h * D;
      const float c = 1.f / std::max(std::sqrt(dot(kh, kh, D)), 1e-12f);
      inv[i * H + h] = c;
      axpy(c, kh, anchor + h * D, D);
    }
  }
  normalise_anchor(anchor, H, D, n);
  const float mean = 1.f / static_cast<float>(H);
  for (int64_t i = 0; i < n; ++i) {
    const float* k = as_float(rows[i], buf, HD);
    float sum = 0.f;
    for (int64_t h = 0; h < H; ++h) sum += dot(k + h * D, anchor + h * D, D) * inv[i * H + h];
    out[logical[i]] = -sum * mean;
  }
}
#pragma GCC pop_options

// The vector tiles' (AVX-512, AVX2) common start: the listed rows padded to whole tiles
// of `tile` slots with the first row, the anchors cleared. Returns the padded count.
inline int64_t start_tiles(Scratch& s, int64_t n, int64_t tile, int64_t HD) {
  const int64_t np = (n + tile - 1) / tile * tile;
  for (int64_t i = n; i < np; ++i) s.rows[i] = s.rows[0];
  std::fill(s.anchor.begin(), s.anchor.begin() + HD, 0.f);
  return np;
}

// Prefetch the key rows of a tile (TILE slots) into L1.
template <int TILE, typename T>
inline void prefetch_rows(const T* const* rows, int64_t bytes) {
  for (int s = 0; s < TILE; ++s)
    for (int64_t o = 0; o < bytes; o += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[s]) + o, 0, 3);
}

#ifdef KVSERVE_KEYDIFF_AVX512
// A head's D = 16 * NV values of T as NV fp32 vectors, in an order of lanes of its own:
// norms and dot products do not depend on it, and the anchors are summed from (and
// dotted with) rows loaded the same way. bf16 pairs come 32 at a time in one load,
// the even elements shifted up and the odd ones masked (bf16 is the top half of an
// fp32): two plain ALU ops, where a widening per 16 takes the shuffle port twice.
template <typename T, int NV>
inline void load_row(const T* p, __m512* v) {
  if constexpr (std::is_same_v<T, float>) {
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(p + 16 * c);
  } else if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 2 == 0) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int c = 0; c < NV / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(p + 32 * c);
      v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
    }
  } else {
    for (int c = 0; c < NV; ++c) v[c] = load16(p + 16 * c);
  }
}

// Sixteen vectors' lane sums as one vector (lane s = the sum of v[s]), by folds (the
// decode kernel's tile_scores takes `fold` from here too): pairs of vectors folded in
// halves, four levels, then one permute undoing the folds' bit-reversed order.
constexpr int fold_index(int h, int i) { return (i / h) % 2 == 0 ? i + h : 16 + i - h; }

template <int H>
inline __m512 fold(__m512 u, __m512 v) {
  constexpr __mmask16 odd = H == 8 ? 0xFF00 : H == 4 ? 0xF0F0 : H == 2 ? 0xCCCC : 0xAAAA;
  const __m512i idx = _mm512_setr_epi32(
      fold_index(H, 0), fold_index(H, 1), fold_index(H, 2), fold_index(H, 3),
      fold_index(H, 4), fold_index(H, 5), fold_index(H, 6), fold_index(H, 7),
      fold_index(H, 8), fold_index(H, 9), fold_index(H, 10), fold_index(H, 11),
      fold_index(H, 12), fold_index(H, 13), fold_index(H, 14), fold_index(H, 15));
  return _mm512_add_ps(_mm512_mask_blend_ps(odd, u, v), _mm512_permutex2var_ps(u, idx, v));
}

constexpr int bitrev4(int j) { return ((j & 1) << 3) | ((j & 2) << 1) | ((j & 4) >> 1) | ((j & 8) >> 3); }

inline __m512 sum16(const __m512* v) {
  __m512 f[8];
  for (int s = 0; s < 8; ++s) f[s] = fold<8>(v[2 * s], v[2 * s + 1]);
  for (int s = 0; s < 4; ++s) f[s] = fold<4>(f[2 * s], f[2 * s + 1]);
  for (int s = 0; s < 2; ++s) f[s] = fold<2>(f[2 * s], f[2 * s + 1]);
  const __m512i order = _mm512_setr_epi32(
      bitrev4(0), bitrev4(1), bitrev4(2), bitrev4(3), bitrev4(4), bitrev4(5), bitrev4(6),
      bitrev4(7), bitrev4(8), bitrev4(9), bitrev4(10), bitrev4(11), bitrev4(12), bitrev4(13),
      bitrev4(14), bitrev4(15));
  return _mm512_permutexvar_ps(order, fold<1>(f[0], f[1]));
}

// D = 16 * NV: both passes 16 listed slots at a time (the list padded to whole tiles
// with its first row), so a norm, a square root and a division, and a cosine's sum, are
// one vector op per 16 slots. Pass 1 prefetches two tiles ahead (blocks lie anywhere in
// the pool: the hardware prefetcher cannot follow); pass 2 finds the row's keys in L2.
// (Prefetching the next row's keys into L2 during pass 2 measured slower.)
template <typename T, int NV>
void score_listed_avx512(int64_t n, int64_t H, float* out, Scratch& s) {
  constexpr int64_t D = 16 * NV;
  const int64_t HD = H * D;
  const int64_t np = start_tiles(s, n, 16, HD);
  const T** rows = reinterpret_cast<const T**>(s.rows.data());
  const int64_t* logical = s.logical.data();
  const int64_t row_bytes = HD * static_cast<int64_t>(sizeof(T));
  float* inv = s.inv.data();  // [H][np]
  float* anchor = s.anchor.data();
  __m512 v[16], x[NV];
  for (int64_t t = 0; t < np; t += 16) {  // pass 1: inverse norms, the anchors' sums
    const __mmask16 valid = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    if (t + 32 < np) prefetch_rows<16>(rows + t + 32, row_bytes);
    for (int64_t h = 0; h < H; ++h) {
      for (int i = 0; i < 16; ++i) {
        load_row<T, NV>(rows[t + i] + h * D, x);
        __m512 acc = _mm512_mul_ps(x[0], x[0]);
        for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(x[c], x[c], acc);
        v[i] = acc;
      }
      const __m512 norm = _mm512_max_ps(_mm512_sqrt_ps(sum16(v)), _mm512_set1_ps(1e-12f));
      const __m512 c16 = _mm512_maskz_div_ps(valid, _mm512_set1_ps(1.f), norm);
      float* ih = inv + h * np + t;
      _mm512_storeu_ps(ih, c16);
      __m512 acc[NV];
      for (int c = 0; c < NV; ++c) acc[c] = _mm512_loadu_ps(anchor + h * D + 16 * c);
      for (int i = 0; i < 16; ++i) {
        const __m512 ci = _mm512_set1_ps(ih[i]);
        load_row<T, NV>(rows[t + i] + h * D, x);
        for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(ci, x[c], acc[c]);
      }
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(anchor + h * D + 16 * c, acc[c]);
    }
  }
  normalise_anchor(anchor, H, D, n);
  const __m512 scale = _mm512_set1_ps(-1.f / static_cast<float>(H));
  alignas(64) float res[16];
  for (int64_t t = 0; t < np; t += 16) {  // pass 2: the cosines, mean over heads
    __m512 sum = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; ++h) {
      __m512 ah[NV];
      for (int c = 0; c < NV; ++c) ah[c] = _mm512_loadu_ps(anchor + h * D + 16 * c);
      for (int i = 0; i < 16; ++i) {
        load_row<T, NV>(rows[t + i] + h * D, x);
        __m512 acc = _mm512_mul_ps(ah[0], x[0]);
        for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(ah[c], x[c], acc);
        v[i] = acc;
      }
      sum = _mm512_fmadd_ps(sum16(v), _mm512_loadu_ps(inv + h * np + t), sum);
    }
    _mm512_store_ps(res, _mm512_mul_ps(sum, scale));
    for (int64_t i = 0; i < std::min<int64_t>(16, n - t); ++i) out[logical[t + i]] = res[i];
  }
}

#endif  // KVSERVE_KEYDIFF_AVX512

#ifdef KVSERVE_KEYDIFF_AVX2
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
// The AVX-512 tiles' form at 8 lanes (CPUs with AVX2 and FMA but no AVX-512): a head's
// D = 8 * NV values as NV vectors, bf16 pairs 16 at a time in one load (the even
// elements shifted up, the odd ones masked: a lane order of its own, as load_row's), a
// tile's 8 norms or cosines reduced by sum8x8's horizontal adds. Without it these CPUs
// took the portable loop, whose sums (no -ffast-math) do not vectorize: KeyDiff's decode
// step was ~3x `full`'s on a Zen 3 host. Unlike the AVX-512 form it sits inside a
// no-fast-math region: compiled with the decode kernel's -ffast-math, its scores left
// the pool op's in the last bits (tests/test_key_stats.py).
template <typename T, int NV>
inline void load_row8(const T* p, __m256* v) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 2 == 0) {
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int c = 0; c < NV / 2; ++c) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c));
      v[2 * c] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      v[2 * c + 1] = _mm256_castsi256_ps(_mm256_and_si256(x, hi));
    }
  } else {
    for (int c = 0; c < NV; ++c) v[c] = load8(p + 8 * c);
  }
}

// D = 8 * NV (16 to 128): both passes 8 listed slots at a time (the list padded to whole
// tiles with its first row); the anchors' sums CH vectors at a time, so that they stay in
// registers (16 of them in AVX2) with the row being added.
template <typename T, int NV>
void score_listed_avx2(int64_t n, int64_t H, float* out, Scratch& s) {
  constexpr int64_t D = 8 * NV;
  constexpr int CH = NV < 8 ? NV : 8;
  const int64_t HD = H * D;
  const int64_t np = start_tiles(s, n, 8, HD);
  const T** rows = reinterpret_cast<const T**>(s.rows.data());
  const int64_t* logical = s.logical.data();
  const int64_t row_bytes = HD * static_cast<int64_t>(sizeof(T));
  float* inv = s.inv.data();  // [H][np]
  float* anchor = s.anchor.data();
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 v[8], x[NV];
  for (int64_t t = 0; t < np; t += 8) {  // pass 1: inverse norms, the anchors' sums
    const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n - t)), _CMP_LT_OQ);
    if (t + 16 < np) prefetch_rows<8>(rows + t + 16, row_bytes);  // two tiles ahead
    for (int64_t h = 0; h < H; ++h) {
      for (int i = 0; i < 8; ++i) {
        load_row8<T, NV>(rows[t + i] + h * D, x);
        __m256 acc = _mm256_mul_ps(x[0], x[0]);
        for (int c = 1; c < NV; ++c) acc = _mm256_fmadd_ps(x[c], x[c], acc);
        v[i] = acc;
      }
      const __m256 norm = _mm256_max_ps(_mm256_sqrt_ps(sum8x8(v)), _mm256_set1_ps(1e-12f));
      float* ih = inv + h * np + t;
      _mm256_storeu_ps(ih, _mm256_and_ps(valid, _mm256_div_ps(_mm256_set1_ps(1.f), norm)));
      float* ah = anchor + h * D;
      for (int c0 = 0; c0 < NV; c0 += CH) {
        __m256 acc[CH];
        for (int c = 0; c < CH; ++c) acc[c] = _mm256_loadu_ps(ah + 8 * (c0 + c));
        for (int i = 0; i < 8; ++i) {
          const __m256 ci = _mm256_set1_ps(ih[i]);
          load_row8<T, NV>(rows[t + i] + h * D, x);
          for (int c = 0; c < CH; ++c) acc[c] = _mm256_fmadd_ps(ci, x[c0 + c], acc[c]);
        }
        for (int c = 0; c < CH; ++c) _mm256_storeu_ps(ah + 8 * (c0 + c), acc[c]);
      }
    }
  }
  normalise_anchor(anchor, H, D, n);
  const __m256 scale = _mm256_set1_ps(-1.f / static_cast<float>(H));
  alignas(32) float res[8];
  for (int64_t t = 0; t < np; t += 8) {  // pass 2: the cosines, mean over heads
    __m256 sum = _mm256_setzero_ps();
    for (int64_t h = 0; h < H; ++h) {
      const float* ah = anchor + h * D;
      for (int i = 0; i < 8; ++i) {
        load_row8<T, NV>(rows[t + i] + h * D, x);
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(ah), x[0]);
        for (int c = 1; c < NV; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(ah + 8 * c), x[c], acc);
        v[i] = acc;
      }
      sum = _mm256_fmadd_ps(sum8x8(v), _mm256_loadu_ps(inv + h * np + t), sum);
    }
    _mm256_store_ps(res, _mm256_mul_ps(sum, scale));
    for (int64_t i = 0; i < std::min<int64_t>(8, n - t); ++i) out[logical[t + i]] = res[i];
  }
}
#pragma GCC pop_options
#endif  // KVSERVE_KEYDIFF_AVX2

// Scores the n > 0 key rows listed in s.rows / s.logical (T: float, BFloat16, Half or
// double;
// each row Hkv * D values, its kv heads in order): out[logical[i]] = slot i's score.
// Slots not listed are left as they are.
template <typename T>
void score_listed(int64_t n, int64_t H, int64_t D, float* out, Scratch& s) {
#ifdef KVSERVE_KEYDIFF_AVX512
  if constexpr (!std::is_same_v<T, double>) {
    if (D == 16) return score_listed_avx512<T, 1>(n, H, out, s);
    if (D == 32) return score_listed_avx512<T, 2>(n, H, out, s);
    if (D == 64) return score_listed_avx512<T, 4>(n, H, out, s);
    if (D == 128) return score_listed_avx512<T, 8>(n, H, out, s);
  }
#elif defined(KVSERVE_KEYDIFF_AVX2)
  if constexpr (!std::is_same_v<T, double>) {
    if (D == 16) return score_listed_avx2<T, 2>(n, H, out, s);
    if (D == 32) return score_listed_avx2<T, 4>(n, H, out, s);
    if (D == 64) return score_listed_avx2<T, 8>(n, H, out, s);
    if (D == 128) return score_listed_avx2<T, 16>(n, H, out, s);
  }
#endif
  score_listed_portable<T>(n, H, D, out, s);
}

}  // namespace keydiff
