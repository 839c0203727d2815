// KeyDiff's key diversity per live slot, read from the pool's keys where they lie.
//
// Registered as torch.ops.kvserve_keys.key_diversity; kvpool/key_stats.py builds it on
// first use and documents the contract, and policies/norms.py::keydiff_scores is the
// reference (and the fallback: no compiler, a quantized pool, another device).
// Why a kernel: the anchor (the mean unit key of a row's live slots) moves every step,
// so every live key is read every step, but the torch form also copies them all into a
// padded fp32 [rows, slots, heads, dim] tensor and makes about six passes over it
// (normalise, mask, sum, divide, matmul, mean). Here each row reads its keys twice in
// place (pass 1: the norms and the anchor; pass 2: the cosines, its keys still in cache)
// and writes one float per slot; rows run in parallel.
//
// Maths as keydiff_scores (fp32): u = k / max(|k|, 1e-12) (F.normalize), anchor_h =
// mean over the row's live slots of u_h, divided by max(|anchor_h|, 1e-8); score =
// -mean over kv heads of u_h . anchor_h. Dead slots (position -1, or no block) score 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVSERVE_AVX512 1
#include <immintrin.h>
#endif

namespace {

// A key row of n values as fp32: the pool's own memory for an fp32 pool, else widened
// into `buf` (exact: bf16 is the top half of an fp32, fp16 converts exactly).
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int64_t x = 0;
#ifdef KVSERVE_AVX512
    for (; x + 16 <= n; x += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x));
      __m512 f;
      if constexpr (std::is_same_v<T, at::BFloat16>)
        f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      else
        f = _mm512_cvtph_ps(h);
      _mm512_storeu_ps(buf + x, f);
    }
#endif
    for (; x < n; ++x) buf[x] = static_cast<float>(src[x]);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t x = 0;
  float s = 0.f;
#ifdef KVSERVE_AVX512
  if (n >= 16) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (x = 16; x + 16 <= n; x += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + x), _mm512_loadu_ps(b + x), acc);
    s = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; x < n; ++x) s += a[x] * b[x];
  return s;
}

inline void axpy(float c, const float* x, float* y, int64_t n) {  // y += c * x
  int64_t i = 0;
#ifdef KVSERVE_AVX512
  const __m512 cv = _mm512_set1_ps(c);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(cv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += c * x[i];
}

// The anchors' sums over `count` live slots -> their means, each divided by its norm
// clamped at 1e-8 (keydiff_scores' clamp).
inline void normalise_anchor(float* anchor, int64_t H, int64_t D, int64_t count) {
  for (int64_t h = 0; h < H; ++h) {
    float* ah = anchor + h * D;
    for (int64_t x = 0; x < D; ++x) ah[x] /= static_cast<float>(count);
    const float c = 1.f / std::max(std::sqrt(dot(ah, ah, D)), 1e-8f);
    for (int64_t x = 0; x < D; ++x) ah[x] *= c;
  }
}

template <typename T>
struct Rows {  // one call's inputs, raw
  const T* k;             // [blocks, bs, Hkv, D]
  const int64_t* table;   // [N, nb]
  const int64_t* pos;     // [N, W]
  float* out;             // [N, W]
  int64_t nb, W, bs, H, D;
};

struct Scratch {  // per thread, reused across its rows
  std::vector<float> inv, anchor, buf;
  std::vector<const void*> rows;  // the tile path's live key rows
  std::vector<int64_t> logical;   // and their slots
};

// One row: pass 1 sums the unit keys (their inverse norms kept per slot and head),
// pass 2 takes each unit key's dot with its head's normalised anchor.
template <typename T>
void score_row(const Rows<T>& a, int64_t r, Scratch& s) {
  const int64_t HD = a.H * a.D;
  const int64_t* pos = a.pos + r * a.W;
  const int64_t* tab = a.table + r * a.nb;
  float* out = a.out + r * a.W;
  std::fill(out, out + a.W, 0.f);
  std::fill(s.anchor.begin(), s.anchor.end(), 0.f);
  float* inv = s.inv.data();
  float* anchor = s.anchor.data();
  float* buf = s.buf.data();
  auto key = [&](int64_t slot) -> const T* {  // nullptr: a dead slot
    const int64_t blk = tab[slot / a.bs];
    if (pos[slot] < 0 || blk < 0) return nullptr;
    return a.k + (blk * a.bs + slot % a.bs) * HD;
  };
  int64_t count = 0;
  for (int64_t j = 0; j < a.W; ++j) {
    const T* src = key(j);
    if (src == nullptr) continue;
    const float* k = as_float(src, buf, HD);
    for (int64_t h = 0; h < a.H; ++h) {
      const float* kh = k + h * a.D;
      const float c = 1.f / std::max(std::sqrt(dot(kh, kh, a.D)), 1e-12f);
      inv[j * a.H + h] = c;
      axpy(c, kh, anchor + h * a.D, a.D);
    }
    ++count;
  }
  if (count == 0) return;
  normalise_anchor(anchor, a.H, a.D, count);
  const float mean = 1.f / static_cast<float>(a.H);
  for (int64_t j = 0; j < a.W; ++j) {
    const T* src = key(j);
    if (src == nullptr) continue;
    const float* k = as_float(src, buf, HD);
    float sum = 0.f;
    for (int64_t h = 0; h < a.H; ++h)
      sum += dot(k + h * a.D, anchor + h * a.D, a.D) * inv[j * a.H + h];
    out[j] = -sum * mean;
  }
}

#ifdef KVSERVE_AVX512
// A head's D = 16 * NV values of T as NV fp32 vectors, in an order of lanes of its own:
// norms and dot products do not depend on it, and the anchors are summed from (and
// dotted with) rows loaded the same way. bf16 pairs come 32 at a time in one load,
// the even elements shifted up and the odd ones masked (bf16 is the top half of an
// fp32): two plain ALU ops, where a widening per 16 takes the shuffle port twice.
template <typename T, int NV>
inline void load_row(const T* p, __m512* v) {
  if constexpr (std::is_same_v<T, float>) {
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(p + 16 * c);
  } else if constexpr (std::is_same_v<T, at::BFloat16> && NV % 2 == 0) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int c = 0; c < NV / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(p + 32 * c);
      v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
    }
  } else {
    for (int c = 0; c < NV; ++c) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c));
      if constexpr (std::is_same_v<T, at::BFloat16>)
        v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      else
        v[c] = _mm512_cvtph_ps(h);
    }
  }
}

// Sixteen vectors' lane sums as one vector (lane s = the sum of v[s]), by the folds of
// paged_decode_cpu.cpp's tile_scores: pairs of vectors folded in halves, four levels,
// then one permute undoing the folds' bit-reversed order.
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

// Prefetch the key rows of a tile (16 slots) into L1.
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t bytes) {
  for (int s = 0; s < 16; ++s)
    for (int64_t o = 0; o < bytes; o += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[s]) + o, 0, 3);
}

// One row, D = 16 * NV: its live slots listed first (key row pointers, padded to whole
// tiles of 16 with the first live row), then both passes 16 slots at a time, so a norm,
// a square root and a division, and a cosine's sum, are one vector op per 16 slots.
// Pass 1 prefetches two tiles ahead (blocks lie anywhere in the pool: the hardware
// prefetcher cannot follow); pass 2 finds the row's keys in L2. (Prefetching the next
// row's keys into L2 during pass 2 measured slower.)
template <typename T, int NV>
void score_row_avx512(const Rows<T>& a, int64_t r, Scratch& s) {
  constexpr int64_t D = 16 * NV;
  const int64_t H = a.H, HD = H * D;
  const int64_t* pos = a.pos + r * a.W;
  const int64_t* tab = a.table + r * a.nb;
  float* out = a.out + r * a.W;
  std::fill(out, out + a.W, 0.f);
  const T** rows = reinterpret_cast<const T**>(s.rows.data());
  int64_t* logical = s.logical.data();
  int64_t n = 0;
  for (int64_t j = 0; j < a.W; ++j) {
    const int64_t blk = tab[j / a.bs];
    if (pos[j] < 0 || blk < 0) continue;
    rows[n] = a.k + (blk * a.bs + j % a.bs) * HD;
    logical[n++] = j;
  }
  if (n == 0) return;
  const int64_t np = (n + 15) / 16 * 16;
  for (int64_t i = n; i < np; ++i) rows[i] = rows[0];
  const int64_t row_bytes = HD * static_cast<int64_t>(sizeof(T));
  float* inv = s.inv.data();  // [H][np]
  float* anchor = s.anchor.data();
  std::fill(anchor, anchor + HD, 0.f);
  __m512 v[16], x[NV];
  for (int64_t t = 0; t < np; t += 16) {  // pass 1: inverse norms, the anchors' sums
    const __mmask16 valid = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    if (t + 32 < np) prefetch_rows(rows + t + 32, row_bytes);
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

template <typename T, int NV>
void score_rows_avx512(const Rows<T>& a, int64_t begin, int64_t end, Scratch& s) {
  for (int64_t r = begin; r < end; ++r) score_row_avx512<T, NV>(a, r, s);
}
#endif

template <typename T>
void score_rows(const Rows<T>& a, int64_t begin, int64_t end, Scratch& s) {
  for (int64_t r = begin; r < end; ++r) score_row(a, r, s);
}

// k_cache [blocks, bs, Hkv, D] (fp32, bf16 or fp16, contiguous); table [N, nb] int64
// (-1: no block); positions [N, W] int64 (-1: dead; W <= nb * bs). -> [N, W] float32.
at::Tensor key_diversity(const at::Tensor& k_cache, const at::Tensor& table,
                         const at::Tensor& positions) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous(),
              "k_cache must be a contiguous [blocks, bs, Hkv, D] tensor");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "k_cache must be float32, bfloat16 or float16 (got ", dt, ")");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong, "table must be [N, nb] int64");
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong &&
                  positions.size(0) == table.size(0), "positions must be [N, W] int64");
  const int64_t n = table.size(0), nb = table.size(1), w = positions.size(1);
  const int64_t bs = k_cache.size(1), h = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(w <= nb * bs, "positions has more slots than the table's blocks");
  const at::Tensor t = table.contiguous(), p = positions.contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(tp[i] < k_cache.size(0), "block id out of range");
  at::Tensor out = at::empty({n, w}, positions.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "key_diversity", [&] {
    const Rows<scalar_t> a{k_cache.data_ptr<scalar_t>(), tp, p.data_ptr<int64_t>(),
                           out.data_ptr<float>(), nb, w, bs, h, d};
    void (*rows)(const Rows<scalar_t>&, int64_t, int64_t, Scratch&) = score_rows<scalar_t>;
#ifdef KVSERVE_AVX512
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (d == 16) rows = score_rows_avx512<scalar_t, 1>;
      if (d == 32) rows = score_rows_avx512<scalar_t, 2>;
      if (d == 64) rows = score_rows_avx512<scalar_t, 4>;
      if (d == 128) rows = score_rows_avx512<scalar_t, 8>;
    }
#endif
    const int64_t wp = (w + 15) / 16 * 16;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      Scratch s{std::vector<float>(wp * h), std::vector<float>(h * d),
                std::vector<float>(h * d), std::vector<const void*>(wp),
                std::vector<int64_t>(wp)};
      rows(a, begin, end, s);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve_keys, m) {
  m.def("key_diversity(Tensor k_cache, Tensor table, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_keys, CPU, m) { m.impl("key_diversity", key_diversity); }
