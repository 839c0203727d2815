// Paged decode attention for CPU: one query per sequence, keys and values read from
// the pool's blocks where they lie (no gather into a padded copy).
//
// Registered as torch.ops.kvserve.paged_decode; attention/cpu_attention.py builds it on
// first use and documents the contract. Same visibility rule as attention/torch_attention.py:
// a slot is seen when its position is >= 0, <= the query's and inside the window.
//
// One job per sequence. Its visible slots are first listed (branch-free), so evicted
// slots, -1 table columns and windows cost nothing further and the maths runs over a
// dense list: scores, softmax, weighted V rows (two passes over the rows; an online
// softmax fusing them measured ~10% slower on the 3m model). With AVX-512 and a head
// dim of 16/32/64/128 the scores come 16 slots at a time (`tile_scores`), the V pass
// keeps a GQA group's output rows in registers and the next rows are prefetched (pool
// blocks lie anywhere, so the hardware prefetcher cannot follow): ~2.2x the previous
// kernel at the 3m model's 64-sequence decode step. CPUs with AVX2 but no AVX-512 take
// the same shape at 8 lanes (paged_decode_avx2.h: ~2.7-3.3x the portable loop at the
// 3m shape on a Zen 3 host); others, and other head dims, the portable loop at the end.
//
// Dtypes: the caches may be narrower than q (an fp32 model over a bf16 or fp16 pool,
// `--kv-cache-dtype`), since decode is bound by the bytes of K/V it reads. The maths is
// fp32 throughout: 16-bit rows are widened as they are loaded (bf16 is the top half of an
// fp32: a shift). The kernel is compiled once per cache dtype (`Batch<TKV>`); q and out
// are touched once per sequence, so their dtype is a run-time switch (`QueryIO`) and any
// model dtype runs over any pool dtype without multiplying the instantiations.
// Quantized pools (int8, fp8 e4m3, int4 with fp16 scales) take `paged_decode_quant` at
// the end. int8 and fp8 have one scale per (slot, kv head), which factors out of a dot
// product: they run the AVX-512 path over the raw codes (widened like 16-bit rows), with
// each score multiplied by its K scale and each probability by its V scale. int4 (a scale
// per 32 channels) and other head dims take the portable loop over dequantized rows.
//
// Two attention variants of newer model families, off unless a call asks (no cost then
// but a test per sequence): Gemma 2's logit soft-capping (`softcap`: the scores of a
// sequence, once computed, become cap * tanh(score / cap) in one pass before the softmax,
// `soft_cap`) and gpt-oss's learned sinks (`sinks`: a logit per query head that joins the
// softmax's max and denominator, with no value; the mass is then the real softmax's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <optional>
#include <string>
#include <vector>

// Compiled as the pool's op is (no -ffast-math), so the scores are the same bits.
#include "../../native/csrc/key_diversity.h"  // the pool op's scoring: the same bits
#include "../../native/csrc/team.h"
// pyramid's window ring: the same bits. Relative, not -I: a build's flags then do not
// name its checkout's path, so checkouts of the same source share one cached build.
#include "../../native/csrc/window_ring.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define KVSERVE_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_AVX2 1
#include <immintrin.h>
#endif

namespace {

// q and out, in the model's dtype. Read and written once per sequence, next to a pass
// over all its K/V rows, so a switch on the dtype there costs nothing measurable.
struct QueryIO {
  const void* q;  // [B, Hq, D], strides s0 and s1, unit last stride
  void* out;      // [B, Hq, D] rows os0 apart (Hq * D, or more for a slice of the heads)
  at::ScalarType dtype;
  int64_t s0, s1, Hq, D;
  float scale;
  int64_t os0;
  // A per-head pool's call (`heads` of paged_decode): its rows are (kv head h, sequence
  // b) pairs, row h * bq + b, and read query heads [h * Hq, (h + 1) * Hq) of sequence b's
  // q and out, hs and ohs elements further along the row than head block 0's. bq == 0:
  // row b is sequence b.
  int64_t bq = 0, hs = 0, ohs = 0;

  int64_t seq(int64_t b) const { return bq == 0 ? b : b % bq; }  // the row's sequence
  int64_t q_at(int64_t b) const { return bq == 0 ? b * s0 : b % bq * s0 + b / bq * hs; }
  int64_t out_at(int64_t b) const { return bq == 0 ? b * os0 : b % bq * os0 + b / bq * ohs; }

  template <typename F>
  void with_type(F f) const {  // dtype checked by paged_decode
    switch (dtype) {
      case at::kFloat: return f(float{});
      case at::kBFloat16: return f(at::BFloat16{});
      case at::kHalf: return f(at::Half{});
      default: return f(double{});
    }
  }
  // dst[h * D + x] = q[b, h, x] * scale, in fp32.
  void read(int64_t b, float* dst) const {
    with_type([&](auto t) {
      const auto* src = static_cast<const decltype(t)*>(q) + q_at(b);
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t x = 0; x < D; ++x)
          dst[h * D + x] = static_cast<float>(src[h * s1 + x]) * scale;
    });
  }
  // out[b, h, x] = src[h * D + x] * (inv ? inv[h] : 1), rounded to the model's dtype.
  void write(int64_t b, const float* src, const float* inv) const {
    with_type([&](auto t) {
      using TQ = decltype(t);
      TQ* dst = static_cast<TQ*>(out) + out_at(b);
      for (int64_t h = 0; h < Hq; ++h) {
        const float f = inv ? inv[h] : 1.f;
        for (int64_t x = 0; x < D; ++x) dst[h * D + x] = static_cast<TQ>(src[h * D + x] * f);
      }
    });
  }
  void zero(int64_t b) const {  // a sequence that sees no slot
    const size_t elem = c10::elementSize(dtype);
    std::memset(static_cast<char*>(out) + out_at(b) * elem, 0, Hq * D * elem);
  }
};

// A window ring each sequence's mass row (summed over every head) is written into, as
// one column, with the ring's exact total (pyramid's observation window, `ring` of
// paged_decode; window_ring.h): sequence b's slot j at values[row(b) * v0 + cols[b] * v1
// + j], its total's digit d at total[row(b) * t0 + d * t1 + j].
struct Ring {
  float* values = nullptr;
  float* total = nullptr;
  const int64_t* cols = nullptr;
  int64_t v0 = 0, v1 = 0, t0 = 0, t1 = 0;
  double up = 0.0;  // 2^shift: a mass's fixed-point scale
};

template <typename TKV>
struct Batch {  // one call's inputs, raw; TKV is the caches' element type
  QueryIO io;
  const TKV *k, *v;
  float* mass;  // [B, Hkv, S], rows ms0 apart, or nullptr when not requested
  const int64_t *table, *slot_pos, *q_pos;
  int64_t B, Hq, Hkv, G, D, bs, NB, S, row_len, window, ms0;
  // Row strides of table and slot_pos: the runner hands the engine's shared tables'
  // rows as they are (a view, wider than NB and S), not a copy of them.
  int64_t ts, ps;
  // Quantized codes only (int8, fp8): slot s's scale at kv head h is ks[s * sstride + h],
  // times sfac (fp8 codes are widened as fp16 bit patterns 2^8 below their value).
  const at::Half *ks = nullptr, *vs = nullptr;
  int64_t sstride = 0;
  float sfac = 1.f;
  bool stream = false;  // the call's K/V come from DRAM: rows are touched, not prefetched
  // KeyDiff's score per visible slot, [B, S] rows kd0 apart, of the sequences flagged in
  // kd_rows [B], or nullptr when not asked (`key_diversity_seq`).
  float* kd = nullptr;
  const bool* kd_rows = nullptr;
  int64_t kd0 = 0;
  bool mass_sum = false;  // mass as [B, 1, S]: summed over the kv heads (`write_mass`)
  // The table row of sequence b: rows[b] of the tables handed in whole when the step's
  // rows are not consecutive (gathering them was a copy of every row's positions a
  // step), else b.
  // A per-head call (`io.bq`) hands a row per sequence, [bq], indexing each head's
  // block of rh table rows: row h * bq + b reads table row h * rh + rows[b].
  const int64_t* rows = nullptr;
  int64_t rh = 0;
  int64_t row(int64_t b) const {
    if (rows == nullptr) return b;
    return io.bq == 0 ? rows[b] : b / io.bq * rh + rows[b % io.bq];
  }
  // A per-slot running sum each sequence's mass row is added into once written (H2O's
  // cumulative attention, `acc` of paged_decode; the row summed over every head, as
  // `mass_sum` writes it): sequence b's slot j at acc[row(b) * acc0 + j], one rounded
  // add, the bits of the policy adding the returned row itself after the step.
  float* acc = nullptr;
  int64_t acc0 = 0;
  Ring ring{};  // ring.values == nullptr: none
  // Attention variants (`Features`): Gemma 2's soft-capping (0: none) and gpt-oss's
  // learned sinks, query head h of sequence b's at sinks[b * sk0 + h] (nullptr: none).
  float softcap = 0.f;
  const float* sinks = nullptr;
  int64_t sk0 = 0;
  // sequence b's query head h's sink logit (only where `sinks`; a per-head call's row
  // h * bq + b reads its head block's, skh = the call's query heads a row, further on)
  int64_t skh = 0;
  float sink(int64_t b, int64_t h) const {
    return sinks[b * sk0 + (io.bq == 0 ? 0 : b / io.bq * skh) + h];
  }
};

// Element type of fp8 e4m3 codes in the vector path (int8 codes are int8_t).
struct Fp8 {
  uint8_t bits;
};
template <typename T>
constexpr bool is_code = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>;

struct Scratch {  // per thread, reused across its sequences
  std::vector<int64_t> phys, logical;
  std::vector<float> qf, sc, tmp;
  std::vector<float> kscale, vscale;  // quantized codes: [Hkv][np] per visible slot
  std::vector<int64_t> slot;          // quantized codes: pool slot of each visible slot
  std::vector<float> rows{};          // AVX2 path, 16-bit pools: a tile's K rows widened
};

template <typename TKV>
using SeqFn = void (*)(const Batch<TKV>&, int64_t, Scratch&);  // one sequence

// Visible slots of sequence b in table order: where the slot's K/V row starts in the
// cache (element offset) and its logical index. Every slot is written and the count
// advances only for visible ones: no per-slot branch.
// With `slot`, also each one's pool slot (quantized codes look their scales up by it).
template <typename TKV>
int64_t visible_slots(const Batch<TKV>& a, int64_t b, int64_t* phys, int64_t* logical,
                      int64_t* slot = nullptr) {
  const int64_t qp = a.q_pos[a.io.seq(b)];
  const int64_t lo = (a.window > 0 && qp >= a.window) ? qp - a.window + 1 : 0;
  int64_t n = 0;
  for (int64_t j = 0; j < a.NB; ++j) {
    const int64_t blk = a.table[a.row(b) * a.ts + j];
    if (blk < 0) continue;
    const int64_t* pos = a.slot_pos + a.row(b) * a.ps + j * a.bs;
    for (int64_t o = 0; o < a.bs; ++o) {
      phys[n] = (blk * a.bs + o) * a.row_len;
      logical[n] = j * a.bs + o;
      if (slot != nullptr) slot[n] = blk * a.bs + o;
      n += (pos[o] >= lo) & (pos[o] <= qp);
    }
  }
  return n;
}

// *dst += x as one rounded add of the two: the empty asm makes x opaque, so -ffast-math
// cannot reassociate the add with the sum that made x (it would then round differently
// from head_sum's add of whole heads).
inline void add_to(float* dst, float x) {
  asm("" : "+v"(x));
  *dst += x;
}

// Gemma 2's soft-capping of one score: cap * tanh(x / cap) (transformers' order).
inline float cap_score(float x, float cap) { return cap * std::tanh(x / cap); }

// Attention mass, only when asked for: probability per slot summed over each kv group's
// heads, head hq's probabilities being p[hq * stride + i] * (norm ? norm[hq] : 1).
// `mass_sum`: one row per sequence, the kv groups' sums added in head order, which is
// how the policy bridge's head_sum adds them (kvpool/policy_rows.py): the same bits,
// in a row Hkv times smaller (tests/test_cpu_attention.py checks both).
template <typename TKV>
void write_mass(const Batch<TKV>& a, int64_t b, const int64_t* logical, int64_t n,
                const float* p, int64_t stride, const float* norm) {
  for (int64_t h = 0; h < a.Hkv; ++h) {
    float* mrow = a.mass + b * a.ms0 + (a.mass_sum ? 0 : h * a.S);
    if (a.mass_sum && h > 0) {
      for (int64_t i = 0; i < n; ++i) {
        float s = 0.f;
        for (int64_t g = h * a.G; g < (h + 1) * a.G; ++g)
          s += p[g * stride + i] * (norm ? norm[g] : 1.f);
        add_to(mrow + logical[i], s);
      }
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.f;
      for (int64_t g = h * a.G; g < (h + 1) * a.G; ++g)
        s += p[g * stride + i] * (norm ? norm[g] : 1.f);
      mrow[logical[i]] = s;
    }
  }
  if (a.acc != nullptr) {  // the row just written, added into the running sum
    const float* mrow = a.mass + b * a.ms0;
    float* arow = a.acc + a.row(b) * a.acc0;
    for (int64_t i = 0; i < n; ++i) add_to(arow + logical[i], mrow[logical[i]]);
  }
  if (a.ring.values != nullptr) {  // the row just written, as its query's ring column:
    // every slot of it, 8 at a time (a slot it does not see gets 0, as the policy's own
    // update writes its row whole; what a dead slot holds is never read)
    const Ring& r = a.ring;
    window_ring::put_row(r.values + a.row(b) * r.v0 + r.cols[a.io.seq(b)] * r.v1, r.total + a.row(b) * r.t0,
                         r.t1, a.mass + b * a.ms0, a.S, r.up);
  }
}

// Prefetch `bytes` from p: LOCALITY 3 into L1 (rows needed next), 2 into L2 (rows
// needed after the whole K pass).
template <int LOCALITY = 3>
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    __builtin_prefetch(static_cast<const char*>(p) + o, 0, LOCALITY);
}

// Read one byte of every cache line of `bytes` from p, in address order. Over a pool
// that comes from DRAM this beats prefetching: the tile loops read a row a head at a
// time (stride: the row), which the hardware prefetchers follow badly, while these
// loads walk each block's rows in order and stay many in flight. The 160M shape in
// bf16, blocks in random order, 12 layers' pools cycled, one thread: 1.34-1.47x faster
// a call from 9 MiB a layer up, e.g. 64 sequences of 400 slots 10.8 -> 7.3 ms
// (benchmarks/bench_decode_kernel.py; commit 970f6f2). In cache it only
// adds loads (~20% at 8 sequences called back to back), hence `Batch::stream`.
inline void touch(const void* p, int64_t bytes) {
  const volatile char* c = static_cast<const volatile char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) (void)c[o];
}

#ifdef KVSERVE_AVX512
using keydiff::widen16;  // key_diversity.h's: one copy

// 16 one-byte codes widened to fp32: int8 exactly; fp8 e4m3 as the fp16 whose exponent
// and mantissa bits are the code's shifted into place, which is the code's value / 2^8
// for normals and subnormals alike (the scale carries the 2^8; e4m3fn's NaN codes never
// occur, quantize() clamps to +-448).
template <typename T>
inline __m512 widen_codes(__m128i c) {
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  } else {
    const __m256i w = _mm256_cvtepu8_epi16(c);
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(mag, sign));
  }
}

// 16 elements of T widened to fp32.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return _mm512_loadu_ps(p);
  else if constexpr (is_code<T>)
    return widen_codes<T>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else
    return widen16<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp for x <= 0 (softmax after subtracting the max): Cephes' expf polynomial, ~1 ulp.
// Clamped at -87 (exp = 1.6e-38, padding lanes too): results never go subnormal, which
// would cost a microcode assist each without flush-to-zero.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap) (Gemma 2's soft-capping), tanh from exp512 of -2|x / cap| (in its
// domain, <= 0): (1 - t) / (1 + t), the sign put back. Absolute error ~1e-7 * cap.
inline __m512 cap512(__m512 x, __m512 cap, __m512 inv_cap) {
  const __m512 y = _mm512_mul_ps(x, inv_cap);
  const __m512 t = exp512(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 th = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
  const __m512 sign = _mm512_and_ps(y, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN)));
  return _mm512_mul_ps(cap, _mm512_or_ps(th, sign));
}

// soft-capping of n scores in place, 16 at a time (a masked tail)
inline void soft_cap(float* x, int64_t n, float cap) {
  const __m512 c = _mm512_set1_ps(cap), ic = _mm512_set1_ps(1.f / cap);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, cap512(_mm512_loadu_ps(x + i), c, ic));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, cap512(_mm512_maskz_loadu_ps(m, x + i), c, ic));
  }
}

// A chunk of R consecutive values, widened to fp32 and repeated 16 / R times (R = 16: a
// plain load). The repeat is a broadcast load, before widening for 16-bit values.
template <typename T, int R>
inline __m512 load_bcast(const T* p) {
  if constexpr (R == 16) {
    return load16(p);
  } else if constexpr (std::is_same_v<T, float>) {
    if constexpr (R == 8) return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
    else return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
  } else if constexpr (is_code<T>) {  // R bytes, repeated before widening
    if constexpr (R == 8) {
      int64_t chunk;
      std::memcpy(&chunk, p, sizeof chunk);
      return widen_codes<T>(_mm_set1_epi64x(chunk));
    } else {
      int32_t chunk;
      std::memcpy(&chunk, p, sizeof chunk);
      return widen_codes<T>(_mm_set1_epi32(chunk));
    }
  } else if constexpr (R == 8) {
    const __m128i chunk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return widen16<T>(_mm256_broadcastsi128_si256(chunk));
  } else {
    int64_t chunk;  // 4 values
    std::memcpy(&chunk, p, sizeof chunk);
    return widen16<T>(_mm256_set1_epi64x(chunk));
  }
}

// One step of summing vectors lane-group-wise: lanes in groups of 2H, the even groups
// keep u's partial sums and the odd ones v's, each folded in half (key_diversity.h's,
// which sums KeyDiff's tiles the same way).
using keydiff::fold;

constexpr int log2i(int r) { return r >= 16 ? 4 : r >= 8 ? 3 : r >= 4 ? 2 : 1; }
constexpr int bitrev(int bits, int j) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((j >> b) & 1) << (bits - 1 - b);
  return r;
}
// After the folds, lane i (within its group of R) holds slot bitrev(i): the undoing permute.
template <int R>
constexpr int unfold(int i) { return (i & ~(R - 1)) | bitrev(log2i(R), i & (R - 1)); }

// The scores of 16 slots (`dot(s)`: slot s's R partial sums for each of GC heads, in
// lanes (head, r)) folded and reordered into GC vectors of 16 scores.
template <int GC, typename Dot>
inline void fold_scores(Dot dot, __m512* out) {
  constexpr int R = 16 / GC, L = log2i(R);
  __m512 f[8];
  for (int s = 0; s < 8; ++s) f[s] = fold<R / 2>(dot(2 * s), dot(2 * s + 1));
  if constexpr (L >= 2) for (int s = 0; s < 4; ++s) f[s] = fold<R / 4>(f[2 * s], f[2 * s + 1]);
  if constexpr (L >= 3) for (int s = 0; s < 2; ++s) f[s] = fold<R / 8>(f[2 * s], f[2 * s + 1]);
  if constexpr (L >= 4) f[0] = fold<1>(f[0], f[1]);
  const __m512i order = _mm512_setr_epi32(
      unfold<R>(0), unfold<R>(1), unfold<R>(2), unfold<R>(3), unfold<R>(4), unfold<R>(5),
      unfold<R>(6), unfold<R>(7), unfold<R>(8), unfold<R>(9), unfold<R>(10), unfold<R>(11),
      unfold<R>(12), unfold<R>(13), unfold<R>(14), unfold<R>(15));
  for (int m = 0; m < GC; ++m) f[m] = _mm512_permutexvar_ps(order, f[m]);
  if constexpr (GC == 1) {
    out[0] = f[0];
  } else if constexpr (GC == 2) {  // f[m] = [head 0, slots 8m.. | head 1, slots 8m..]
    out[0] = _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(1, 0, 1, 0));
    out[1] = _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 2, 3, 2));
  } else {  // f[m]'s 128-bit block g = head g, slots 4m..4m+3: transpose the 4x4 blocks
    const __m512 t0 = _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 t1 = _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 t2 = _mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 t3 = _mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(3, 2, 3, 2));
    out[0] = _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));
    out[1] = _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
    out[2] = _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
    out[3] = _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Scores of 16 slots for GC query heads of one kv head: out[g] lane s = q_g . k_s.
// row(s) is slot s's K row at the kv head; qv holds the GC heads' queries (pre-scaled)
// as J = D * GC / 16 vectors whose lanes are (head g, dim j*R + r), R = 16 / GC.
// Each slot costs J FMAs against its K row broadcast in chunks of R, leaving R partial
// sums per head; log2(R) fold levels reduce 16 such vectors to GC vectors of 16 scores.
// GC > 1 (GQA) shares one K load between heads and skips fold levels: the 3m model's
// 4 heads per kv head run at about half the cost of GC = 1.
template <typename T, int NV, int GC, typename Row>
inline void tile_scores(Row row, const __m512* qv, __m512* out) {
  constexpr int R = 16 / GC, J = NV * GC;
  fold_scores<GC>([&](int s) {
    const T* k = row(s);
    __m512 acc = _mm512_mul_ps(qv[0], load_bcast<T, R>(k));
    for (int j = 1; j < J; ++j) acc = _mm512_fmadd_ps(qv[j], load_bcast<T, R>(k + j * R), acc);
    return acc;
  }, out);
}

#if defined(__AVX512BF16__)
#define KVSERVE_DECODE_BF16_DOT 1
// R channel pairs of a bf16 K row (2R values) in every group of R lanes: `load_bcast`'s
// layout for `vdpbf16ps`, whose lane i sums the products of its operands' elements 2i
// and 2i + 1.
template <int R>
inline __m512i pair_bcast(const c10::BFloat16* p) {
  static_assert(R == 16 || R == 8 || R == 4, "R = 16 / GC, GC 1, 2 or 4");
  if constexpr (R == 16) {
    return _mm512_loadu_si512(p);
  } else if constexpr (R == 8) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// `tile_scores` for a bf16 cache and bf16 queries, unscaled: `vdpbf16ps` over channel
// pairs (qp: J / 2 vectors of the GC heads' q pairs in tile_scores' lane order). The
// products of two bf16 values are exact in fp32 and summed in fp32, as the widened FMAs
// sum them but for the pairing; half the multiply instructions, and no widening of K.
template <int NV, int GC, typename Row>
inline void tile_scores_bf16(Row row, const __m512i* qp, __m512* out) {
  constexpr int R = 16 / GC, J2 = NV * GC / 2;
  fold_scores<GC>([&](int s) {
    const c10::BFloat16* k = row(s);
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < J2; ++j)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)qp[j], (__m512bh)pair_bcast<R>(k + j * 2 * R));
    return acc;
  }, out);
}
#endif

// One sequence, head dim D = 16 * NV, query heads taken GC at a time (GC divides G).
template <typename TKV, int NV, int GC>
void decode_seq_avx512(const Batch<TKV>& a, int64_t b, Scratch& w) {
  constexpr int64_t D = 16 * NV;
  constexpr int R = 16 / GC, J = NV * GC;
  const int64_t Hq = a.Hq, G = a.G, rl = a.row_len;
  int64_t* slot = is_code<TKV> ? w.slot.data() : nullptr;
  const int64_t n = visible_slots(a, b, w.phys.data(), w.logical.data(), slot);
  if (n == 0) return a.io.zero(b);
  float* qf = w.qf.data();  // per chunk of GC heads, J vectors laid out for tile_scores
#ifdef KVSERVE_DECODE_BF16_DOT
  // bf16 queries against a bf16 cache: q's channel pairs, unscaled (exact as they are),
  // J / 2 vectors a chunk of heads in qf's memory; the scale multiplies the scores.
  constexpr bool kPairs = std::is_same_v<TKV, c10::BFloat16> && J % 2 == 0;
  const bool pairs = kPairs && a.io.dtype == at::kBFloat16;
#else
  constexpr bool pairs = false;
#endif
  if (pairs) {
    const auto* q = static_cast<const c10::BFloat16*>(a.io.q) + a.io.q_at(b);
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t x = 0; x < D; x += 2) {
        const uint32_t pair = q[hq * a.io.s1 + x].x | static_cast<uint32_t>(q[hq * a.io.s1 + x + 1].x) << 16;
        std::memcpy(qf + ((hq / GC * J / 2) + x / 2 / R) * 16 + (hq % GC) * R + x / 2 % R, &pair, 4);
      }
  } else {
    a.io.read(b, w.tmp.data());
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t x = 0; x < D; ++x)
        qf[((hq / GC * J) + x / R) * 16 + (hq % GC) * R + x % R] = w.tmp[hq * D + x];
  }
  const int64_t np = (n + 15) / 16 * 16;  // score rows padded to whole tiles
  float* sc = w.sc.data();                // [Hq][np]
  const int64_t* phys = w.phys.data();
  float *ksc = nullptr, *vsc = nullptr;  // codes: each visible slot's scales per kv head
  if constexpr (is_code<TKV>) {
    ksc = w.kscale.data();
    vsc = w.vscale.data();
    for (int64_t i = 0; i < np; ++i) {
      const int64_t at = slot[std::min(i, n - 1)] * a.sstride;
      for (int64_t h = 0; h < a.Hkv; ++h) {  // fp16 -> fp32 in one instruction (F16C)
        ksc[h * np + i] = _cvtsh_ss(a.ks[at + h].x) * a.sfac;
        vsc[h * np + i] = _cvtsh_ss(a.vs[at + h].x) * a.sfac;
      }
    }
  }
  // The V rows ride along into L2 when they all fit there (3m: ~10% faster); a 160m
  // sequence's V (MBs) would only push out its own first rows.
  const int64_t row_bytes = rl * sizeof(TKV);
  const int64_t v_ahead = n * row_bytes <= (256 << 10) ? row_bytes : 0;
  for (int64_t t = 0; t < np; t += 16) {
    for (int s = 0; s < 16; ++s) {  // the next tile's rows
      const int64_t next = phys[std::min(t + 16 + s, n - 1)];
      if (a.stream)
        touch(a.k + next, row_bytes);
      else
        prefetch(a.k + next, row_bytes);
      prefetch<2>(a.v + next, v_ahead);
    }
    // Usually the tile's 16 rows follow each other in one block: address them from the
    // first. Otherwise (evicted slots, block edges, the last tile) list them; a short
    // last tile repeats its last slot and masks those lanes.
    bool contiguous = n - t >= 16;
    for (int s = 1; s < 16 && contiguous; ++s) contiguous = phys[t + s] == phys[t] + s * rl;
    const TKV* rows[16];
    for (int s = 0; s < 16; ++s) rows[s] = a.k + phys[std::min(t + s, n - 1)];
    const __mmask16 live = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    for (int64_t h = 0, hq = 0; h < a.Hkv; ++h) {
      const int64_t off = h * D;
      for (int64_t g = 0; g < G; g += GC, hq += GC) {
        __m512 s[GC];
#ifdef KVSERVE_DECODE_BF16_DOT
        if constexpr (kPairs) {
          if (pairs) {
            __m512i qp[J / 2];
            for (int j = 0; j < J / 2; ++j) qp[j] = _mm512_loadu_si512(qf + (hq / GC * J / 2 + j) * 16);
            if (contiguous)
              tile_scores_bf16<NV, GC>([&](int i) { return rows[0] + i * rl + off; }, qp, s);
            else
              tile_scores_bf16<NV, GC>([&](int i) { return rows[i] + off; }, qp, s);
            const __m512 scale = _mm512_set1_ps(a.io.scale);
            for (int c = 0; c < GC; ++c) s[c] = _mm512_mul_ps(s[c], scale);
          }
        }
#endif
        if (!pairs) {
          __m512 qv[J];
          for (int j = 0; j < J; ++j) qv[j] = _mm512_loadu_ps(qf + (hq / GC * J + j) * 16);
          if (contiguous)
            tile_scores<TKV, NV, GC>([&](int i) { return rows[0] + i * rl + off; }, qv, s);
          else
            tile_scores<TKV, NV, GC>([&](int i) { return rows[i] + off; }, qv, s);
        }
        if constexpr (is_code<TKV>) {  // q . (s_k * codes) = s_k * (q . codes)
          const __m512 kv_scale = _mm512_loadu_ps(ksc + h * np + t);
          for (int c = 0; c < GC; ++c) s[c] = _mm512_mul_ps(s[c], kv_scale);
        }
        for (int c = 0; c < GC; ++c)  // masked lanes: exp gives ~0, and they are never read
          _mm512_storeu_ps(sc + (hq + c) * np + t,
                           _mm512_mask_blend_ps(live, _mm512_set1_ps(-1e30f), s[c]));
      }
    }
  }
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) prefetch(a.v + phys[i], row_bytes);
  if (b + 1 < a.B && a.table[a.row(b + 1) * a.ts] >= 0) {  // the next sequence's first block
    const int64_t first = a.table[a.row(b + 1) * a.ts] * a.bs * rl;
    prefetch<2>(a.k + first, a.bs * row_bytes);
    prefetch<2>(a.v + first, a.bs * row_bytes);
  }
  if (a.softcap > 0.f)  // the live lanes only: the padding's -1e30 must stay out of the sum
    for (int64_t hq = 0; hq < Hq; ++hq) soft_cap(sc + hq * np, n, a.softcap);
  float* inv = w.tmp.data();  // 1 / softmax denominator per query head
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* row = sc + hq * np;
    __m512 mx = _mm512_loadu_ps(row);
    for (int64_t t = 16; t < np; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
    float m = _mm512_reduce_max_ps(mx);
    if (a.sinks != nullptr) m = std::max(m, a.sink(b, hq));  // the sink joins max and sum
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < np; t += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), mv));
      _mm512_storeu_ps(row + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    float total = _mm512_reduce_add_ps(sum);
    if (a.sinks != nullptr) total += std::exp(a.sink(b, hq) - m);
    inv[hq] = 1.f / total;
  }
  // Weighted V rows, PT slots at a time so that the tile's rows stay in L1 while each
  // kv head's part is read. GC heads share each V load; U slots are in flight per step
  // so that U * GC * NV accumulators hide the FMA latency. `ob` carries sums across tiles.
  constexpr int U = GC * NV >= 8 ? 1 : 8 / (GC * NV);
  constexpr int64_t PT = 64;
  float* ob = w.tmp.data() + Hq;  // [Hq][D]
  std::fill(ob, ob + Hq * D, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += PT) {
    const int64_t t1 = std::min(t0 + PT, n);
    for (int64_t i = t0; i < t1; ++i)  // from DRAM: this tile's rows, in order; else the
      if (a.stream)                    // next tile's, while this one is summed
        touch(a.v + phys[i], row_bytes);
      else
        prefetch(a.v + phys[std::min(i + PT, n - 1)], row_bytes);
    for (int64_t h = 0, hq = 0; h < a.Hkv; ++h) {
      const TKV* vh = a.v + h * D;
      const float* vs_h = vsc == nullptr ? nullptr : vsc + h * np;
      for (int64_t g = 0; g < G; g += GC, hq += GC) {
        __m512 acc[U][GC][NV];
        for (int u = 0; u < U; ++u)
          for (int c = 0; c < GC; ++c)
            for (int x = 0; x < NV; ++x)
              acc[u][c][x] = u ? _mm512_setzero_ps() : _mm512_loadu_ps(ob + (hq + c) * D + 16 * x);
        auto step = [&](int u, int64_t i) {
          __m512 v[NV];
          for (int x = 0; x < NV; ++x) v[x] = load16(vh + phys[i] + 16 * x);
          const float v_scale = is_code<TKV> ? vs_h[i] : 1.f;  // p * (s_v * codes)
          for (int c = 0; c < GC; ++c) {
            const __m512 p = _mm512_set1_ps(sc[(hq + c) * np + i] * v_scale);
            for (int x = 0; x < NV; ++x) acc[u][c][x] = _mm512_fmadd_ps(p, v[x], acc[u][c][x]);
          }
        };
        int64_t i = t0;
        for (; i + U <= t1; i += U)
          for (int u = 0; u < U; ++u) step(u, i + u);
        for (; i < t1; ++i) step(0, i);
        for (int u = 1; u < U; ++u)
          for (int c = 0; c < GC; ++c)
            for (int x = 0; x < NV; ++x) acc[0][c][x] = _mm512_add_ps(acc[0][c][x], acc[u][c][x]);
        for (int c = 0; c < GC; ++c)
          for (int x = 0; x < NV; ++x) _mm512_storeu_ps(ob + (hq + c) * D + 16 * x, acc[0][c][x]);
      }
    }
  }
  a.io.write(b, ob, inv);
  if (a.mass != nullptr) write_mass(a, b, w.logical.data(), n, sc, np, inv);
}

// Query heads per chunk: GQA groups of up to 4 heads, within 8 query vectors (and 8
// accumulators) in registers: 4 at d <= 32, 2 at d = 64, 1 at d = 128. 16-bit caches
// too (K chunks broadcast, then widened): at the 3m shape ~20% faster than one head at
// a time, since each K row is loaded and widened once for the group.
template <typename TKV, int NV>
SeqFn<TKV> pick_seq(int64_t G) {
  constexpr int G4 = 4 * NV <= 8 ? 4 : 1, G2 = 2 * NV <= 8 ? 2 : 1;
  if (G4 > 1 && G % G4 == 0) return decode_seq_avx512<TKV, NV, G4>;
  if (G2 > 1 && G % G2 == 0) return decode_seq_avx512<TKV, NV, G2>;
  return decode_seq_avx512<TKV, NV, 1>;
}

#include "causal_prefill.h"  // a fresh prompt's causal attention: the same exp512 and load16
#endif  // KVSERVE_AVX512

#ifdef KVSERVE_AVX2
#include "paged_decode_avx2.h"  // the vector path of CPUs with AVX2 but no AVX-512
#endif

// Portable path: per visible slot, a dot product per head; softmax; weighted V rows.
// `row(base, phys)` returns the fp32 row of Hkv * D values at element offset `phys` of
// `base` (the K or V plane), widening or dequantizing into `buf` as it must: the one
// loop serves every pool format.
template <typename TKV, typename Row>
void decode_seq_rows(const Batch<TKV>& a, int64_t b, Scratch& w, Row row) {
  const int64_t Hq = a.Hq, G = a.G, D = a.D;
  const int64_t n = visible_slots(a, b, w.phys.data(), w.logical.data());
  if (n == 0) return a.io.zero(b);
  float *qf = w.qf.data(), *sc = w.sc.data(), *acc = w.tmp.data() + a.Hkv * D;
  a.io.read(b, qf);
  for (int64_t i = 0; i < n; ++i) {
    const float* k = row(a.k, w.phys[i]);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float *kh = k + (hq / G) * D, *qh = qf + hq * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t x = 0; x < D; ++x) s += qh[x] * kh[x];
      sc[hq * n + i] = s;
    }
  }
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* sh = sc + hq * n;
    if (a.softcap > 0.f)
      for (int64_t i = 0; i < n; ++i) sh[i] = cap_score(sh[i], a.softcap);
    float mx = *std::max_element(sh, sh + n);
    if (a.sinks != nullptr) mx = std::max(mx, a.sink(b, hq));  // the sink joins max and sum
    float sum = a.sinks != nullptr ? std::exp(a.sink(b, hq) - mx) : 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (sh[i] = std::exp(sh[i] - mx));
    for (int64_t i = 0; i < n; ++i) sh[i] /= sum;
  }
  std::fill(acc, acc + Hq * D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* v = row(a.v, w.phys[i]);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float p = sc[hq * n + i], *vh = v + (hq / G) * D;
      float* ah = acc + hq * D;
#pragma omp simd
      for (int64_t x = 0; x < D; ++x) ah[x] += p * vh[x];
    }
  }
  a.io.write(b, acc, nullptr);
  if (a.mass != nullptr) write_mass(a, b, w.logical.data(), n, sc, n, nullptr);
}

template <typename TKV>
void decode_seq_portable(const Batch<TKV>& a, int64_t b, Scratch& w) {
  float* buf = w.tmp.data();
  const int64_t n = a.Hkv * a.D;  // the row, or a head slice's part of it
  decode_seq_rows(a, b, w, [&](const TKV* base, int64_t phys) {
    const TKV* src = base + phys;
    if constexpr (std::is_same_v<TKV, float>) return src;  // fp32 rows in place
    for (int64_t x = 0; x < n; ++x) buf[x] = static_cast<float>(src[x]);
    return static_cast<const float*>(buf);
  });
}

// KeyDiff's score of sequence b's visible slots (key_diversity.h, the maths of the
// pool's op kvserve_storage::key_diversity), run right after the sequence's attention read
// its K rows: they are still in L2, where the separate op read every key from DRAM
// after the step. Decode without a window sees exactly the live slots the policy scores.
template <typename TKV>
void key_diversity_seq(const Batch<TKV>& a, int64_t b, Scratch& w, keydiff::Scratch& s) {
  if constexpr (is_code<TKV> || std::is_same_v<TKV, uint8_t>) {
    TORCH_CHECK(false, "key_diversity is for float pools");
  } else {
  const int64_t n = visible_slots(a, b, w.phys.data(), w.logical.data());
  if (n == 0) return;
  const TKV** rows = reinterpret_cast<const TKV**>(s.rows.data());
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = a.k + w.phys[i];
    s.logical[i] = w.logical[i];
  }
  keydiff::score_listed<TKV>(n, a.Hkv, a.D, a.kd + b * a.kd0, s);
  }
}

// kv heads [h0, h1) of every sequence: q, out, K, V and mass start at the slice's first
// head; row and batch strides stay the whole call's.
template <typename TKV>
Batch<TKV> head_slice(const Batch<TKV>& a, int64_t h0, int64_t h1) {
  Batch<TKV> s = a;
  const int64_t q0 = h0 * a.G;
  const size_t elem = c10::elementSize(a.io.dtype);
  s.io.q = static_cast<const char*>(a.io.q) + q0 * a.io.s1 * elem;
  s.io.out = static_cast<char*>(a.io.out) + q0 * a.D * elem;
  s.io.Hq = s.Hq = (h1 - h0) * a.G;
  s.Hkv = h1 - h0;
  s.k = a.k + h0 * a.D;
  s.v = a.v + h0 * a.D;
  if (a.mass != nullptr) s.mass = a.mass + h0 * a.S;
  if (a.sinks != nullptr) s.sinks = a.sinks + q0;
  if (a.ks != nullptr) {  // one scale per kv head (int8, fp8)
    s.ks = a.ks + h0;
    s.vs = a.vs + h0;
  }
  return s;
}

// The vector path for the usual head dims (AVX-512: whole vectors of 16, NV of them;
// AVX2: of 8, paged_decode_avx2.h), or nullptr.
template <typename TKV>
SeqFn<TKV> vector_seq(const Batch<TKV>& a) {
#ifdef KVSERVE_AVX512
  if constexpr (!std::is_same_v<TKV, double> && !std::is_same_v<TKV, uint8_t>) {
    if (a.D == 16) return pick_seq<TKV, 1>(a.G);
    if (a.D == 32) return pick_seq<TKV, 2>(a.G);
    if (a.D == 64) return pick_seq<TKV, 4>(a.G);
    if (a.D == 128) return pick_seq<TKV, 8>(a.G);
  }
#elif defined(KVSERVE_AVX2)
  if constexpr (!std::is_same_v<TKV, double> && !std::is_same_v<TKV, uint8_t> && !is_code<TKV>) {
    if (a.D == 16) return pick_seq_avx2<TKV, 2>(a.G);
    if (a.D == 32) return pick_seq_avx2<TKV, 4>(a.G);
    if (a.D == 64) return pick_seq_avx2<TKV, 8>(a.G);
    if (a.D == 128) return pick_seq_avx2<TKV, 16>(a.G);
  }
#endif
  return nullptr;
}

// K/V bytes of one call from which they are taken to come from DRAM (`Batch::stream`):
// a call is one layer, and a model of several layers whose calls read this much each
// reads more per step than the L3 of this repo's machine (32 MB) holds. sysconf's
// reading of the L3 is the host's in a VM (384 MB here), so the size is fixed.
constexpr int64_t kStreamBytes = 8 << 20;

// Every sequence of the batch through `seq`, in parallel. Fewer sequences than threads
// (one long chat): each sequence is cut into slices of its kv heads, each a Batch of its
// own over the same rows, so no core sits idle.
template <typename TKV>
void run(const Batch<TKV>& batch, SeqFn<TKV> seq) {
  Batch<TKV> a = batch;
  a.stream = 2 * a.B * a.S * a.row_len * static_cast<int64_t>(sizeof(TKV)) > kStreamBytes;
  const int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, D = a.D, S = a.S;
  // A small call runs on the calling thread (team.h): the K/V elements it reads at
  // most, each sequence's positions up to its query's (its table may be wider).
  int64_t reads = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t upto = std::min(S, a.q_pos[a.io.seq(b)] + 1);
    reads += 2 * a.row_len * (a.window > 0 ? std::min(upto, a.window) : upto);
  }
  const bool alone = reads < team::decode_parallel_elements();
  // (Not with `mass_sum`, `acc` or `ring`: a slice would write its heads' part of one row.)
  const int64_t slices = B == 0 || alone || a.mass_sum || a.acc != nullptr || a.ring.values != nullptr
      ? 1 : std::min(Hkv, (at::get_num_threads() + B - 1) / B);
  const int64_t scales = a.ks == nullptr ? 0 : Hkv * (S + 16);
  std::vector<Batch<TKV>> parts;
  for (int64_t j = 0; j < slices; ++j) parts.push_back(head_slice(a, Hkv * j / slices,
                                                                   Hkv * (j + 1) / slices));
  team::parallel_for(0, B * slices, alone ? std::max<int64_t>(B, 1) : 1, [&](int64_t begin, int64_t end) {
    Scratch w{std::vector<int64_t>(S), std::vector<int64_t>(S), std::vector<float>(Hq * D),
              std::vector<float>(Hq * (S + 16)), std::vector<float>(Hkv * D + Hq * (D + 1)),
              std::vector<float>(scales), std::vector<float>(scales),
              std::vector<int64_t>(a.ks == nullptr ? 0 : S)};
#ifdef KVSERVE_AVX2
    if constexpr (!std::is_same_v<TKV, float>) w.rows.resize(8 * a.row_len);
#endif
    if (a.kd == nullptr) {
      for (int64_t t = begin; t < end; ++t) seq(parts[t % slices], t / slices, w);
      return;
    }
    keydiff::Scratch kds(S, Hkv, D);
    for (int64_t t = begin; t < end; ++t) {
      seq(parts[t % slices], t / slices, w);
      if (t % slices == 0 && a.kd_rows[a.io.seq(t / slices)]) key_diversity_seq(a, t / slices, w, kds);
    }
  });
}

// q and out [Bq, Hq, D] as the kernels read them; `heads` > 1: a per-head pool's call,
// its rows (kv head h, sequence b) reading head block h of q and out (`QueryIO::bq`).
QueryIO query_io(const at::Tensor& q, at::Tensor& out, double scale, int64_t heads) {
  const int64_t Hq = q.size(1) / heads, D = q.size(2);
  QueryIO io{q.data_ptr(), out.data_ptr(), q.scalar_type(), q.stride(0), q.stride(1),
             Hq, D, static_cast<float>(scale), q.size(1) * D};
  if (heads > 1) {
    io.bq = q.size(0);
    io.hs = Hq * q.stride(1);
    io.ohs = Hq * D;
  }
  return io;
}

template <typename TKV>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& table, const at::Tensor& slot_pos, const at::Tensor& q_pos,
            double scale, int64_t window, at::Tensor& out, float* mass, float* kd,
            const bool* kd_rows, bool mass_sum, const int64_t* rows, float* acc,
            int64_t acc0, const Ring& ring, float softcap, const float* sinks, int64_t sk0,
            int64_t heads) {
  const int64_t B = q.size(0) * heads, Hq = q.size(1) / heads, D = q.size(2), bs = k_cache.size(1);
  const int64_t Hkv = k_cache.size(2), NB = table.size(1);
  const QueryIO io = query_io(q, out, scale, heads);
  Batch<TKV> a{io, k_cache.data_ptr<TKV>(), v_cache.data_ptr<TKV>(), mass,
                     table.data_ptr<int64_t>(), slot_pos.data_ptr<int64_t>(),
                     q_pos.data_ptr<int64_t>(), B, Hq, Hkv, Hq / Hkv, D, bs, NB, NB * bs,
                     Hkv * D, window, Hkv * NB * bs, table.stride(0), slot_pos.stride(0)};
  a.kd = kd;
  a.kd_rows = kd_rows;
  a.rows = rows;
  a.rh = table.size(0) / heads;
  a.skh = Hq;
  a.kd0 = NB * bs;
  a.mass_sum = mass_sum;
  if (mass_sum) a.ms0 = NB * bs;
  a.acc = acc;
  a.acc0 = acc0;
  a.ring = ring;
  a.softcap = softcap;
  a.sinks = sinks;
  a.sk0 = sk0;
  SeqFn<TKV> seq = vector_seq(a);
  run(a, seq == nullptr ? decode_seq_portable<TKV> : seq);
}

bool is_float_type(at::ScalarType t) {  // what QueryIO and the dispatch below take
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

// A [B, n] int64 table or position rows as the kernel reads them: a view whose rows are
// contiguous (each row read at its own stride) as it is, anything else copied.
at::Tensor rows_of(const at::Tensor& x) {
  return x.dim() == 2 && x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

// `rows` [B] int64: the table rows of the call's sequences, when table and slot_pos are
// handed whole ([Rt, NB] and [Rt, NB*bs] views of the engine's tables); none: row b is
// sequence b. A per-head call (`heads` > 1, B sequences): the tables' rows are `heads`
// blocks of Rt / heads, one a kv head, and rows[b] indexes within each (`Batch::row`);
// none: they are the call's heads * B rows. Checked here, read as `Batch::rows`.
const int64_t* table_rows(const std::optional<at::Tensor>& rows, int64_t B, int64_t heads,
                          int64_t rt, at::Tensor& keep) {
  TORCH_CHECK(heads >= 1 && rt % heads == 0, "heads must be >= 1 and divide the table's rows");
  if (!rows.has_value()) {
    TORCH_CHECK(rt == B * heads, "table and slot_pos must have a row per sequence (and kv head), "
                "or rows must be given");
    return nullptr;
  }
  keep = rows->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kLong && keep.dim() == 1 && keep.size(0) == B,
              "rows must be a [B] int64 tensor");
  const int64_t* r = keep.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(r[b] >= 0 && r[b] < rt / heads, "row out of range");
  return r;
}

// `heads` of paged_decode and paged_decode_quant: checked against q and the pool.
int64_t row_heads(const at::Tensor& q, int64_t heads, int64_t hkv) {
  TORCH_CHECK(heads >= 1 && q.size(1) % heads == 0 && (q.size(1) / heads) % hkv == 0,
              "heads must divide q's heads into groups of a multiple of the pool's kv heads");
  return heads;
}

// softcap (Gemma 2; 0: none) and sinks (gpt-oss; [Hq] float32, or [B, Hq]: a row per
// sequence, a per-head pool's rows being (kv head, sequence) pairs): checked, and the
// sinks' pointer and row stride (0 for [Hq]) for `Batch`.
const float* features_of(double softcap, const std::optional<at::Tensor>& sinks, int64_t B,
                         int64_t Hq, at::Tensor& keep, int64_t& sk0) {
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "softcap must be >= 0 (0: none)");
  sk0 = 0;
  if (!sinks.has_value()) return nullptr;
  keep = sinks->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat &&
                  ((keep.dim() == 1 && keep.size(0) == Hq) ||
                   (keep.dim() == 2 && keep.size(0) == B && keep.size(1) == Hq)),
              "sinks must be float32 [Hq] or [B, Hq] (a logit per query head)");
  sk0 = keep.dim() == 2 ? Hq : 0;
  return keep.data_ptr<float>();
}

std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& table,
                                     const at::Tensor& slot_pos, const at::Tensor& q_pos,
                                     double scale, int64_t window, bool return_probs,
                                     const std::optional<at::Tensor>& key_diversity,
                                     bool sum_heads, const std::optional<at::Tensor>& rows,
                                     const std::optional<at::Tensor>& acc,
                                     const std::optional<at::Tensor>& ring,
                                     const std::optional<at::Tensor>& ring_total,
                                     const std::optional<at::Tensor>& ring_cols,
                                     int64_t ring_shift, double softcap,
                                     const std::optional<at::Tensor>& sinks, int64_t heads) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with unit last stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must share a dtype");
  TORCH_CHECK(is_float_type(q.scalar_type()) && is_float_type(k_cache.scalar_type()),
              "q and the caches must be float32, bfloat16, float16 or float64 (got ",
              q.scalar_type(), " and ", k_cache.scalar_type(), ")");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the caches must share a head dim");
  TORCH_CHECK(table.scalar_type() == at::kLong && slot_pos.scalar_type() == at::kLong &&
                  q_pos.scalar_type() == at::kLong, "table, slot_pos and q_pos must be int64");
  // The call's rows: a sequence each, or (`heads` > 1, a per-head pool) a (kv head,
  // sequence) pair each, head-major; q, out, q_pos, key_diversity and ring_cols stay a
  // row a sequence (`QueryIO::bq`), mass and kd are a row a call's row.
  const int64_t nb = q.size(0) * row_heads(q, heads, k_cache.size(2));
  const at::Tensor t = rows_of(table), p = rows_of(slot_pos), qp = q_pos.contiguous();
  TORCH_CHECK(t.dim() == 2 && p.dim() == 2 && p.size(0) == t.size(0) && p.size(1) == t.size(1) * k_cache.size(1) &&
                  qp.numel() == q.size(0), "slot_pos must be [B, NB*bs] and q_pos [B]");
  at::Tensor rows_keep;
  const int64_t* rp = table_rows(rows, q.size(0), heads, t.size(0), rows_keep);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor mass = return_probs
      ? team::zeros({nb, sum_heads ? 1 : k_cache.size(2), p.size(1)}, q.options().dtype(at::kFloat))
      : at::empty({0}, q.options().dtype(at::kFloat));
  float* mp = return_probs ? mass.data_ptr<float>() : nullptr;
  // key_diversity: [B] bool, the rows whose KeyDiff scores to return (others: 0)
  const bool want_kd = key_diversity.has_value();
  at::Tensor kd_rows;
  if (want_kd) {
    kd_rows = key_diversity->contiguous();
    TORCH_CHECK(kd_rows.scalar_type() == at::kBool && kd_rows.dim() == 1 && kd_rows.size(0) == q.size(0),
                "key_diversity must be a [B] bool tensor of the rows to score");
    TORCH_CHECK(window == 0, "key_diversity needs every live slot visible (no window)");
  }
  at::Tensor kd = want_kd ? team::zeros({nb, p.size(1)}, q.options().dtype(at::kFloat))
                          : at::empty({0}, q.options().dtype(at::kFloat));
  float* kp = want_kd ? kd.data_ptr<float>() : nullptr;
  const bool* kr = want_kd ? kd_rows.data_ptr<bool>() : nullptr;
  // acc: [Rt, >= NB*bs] float32, a row per table row, slots contiguous: each sequence's
  // mass row (summed over every head) is added into its row as the kernel writes it
  float* ap = nullptr;
  int64_t a0 = 0;
  if (acc.has_value()) {
    TORCH_CHECK(return_probs && (sum_heads || k_cache.size(2) == 1),
                "acc adds the mass summed over every head: return_probs and sum_heads");
    TORCH_CHECK(acc->scalar_type() == at::kFloat && acc->dim() == 2 && acc->stride(1) == 1 &&
                    acc->size(0) == t.size(0) && acc->size(1) >= p.size(1),
                "acc must be [rows, >= NB*bs] float32 with contiguous slots, a row per table row");
    ap = acc->data_ptr<float>();
    a0 = acc->stride(0);
  }
  // ring [Rt, a, >= NB*bs] and ring_total [Rt, 3, >= NB*bs] float32 (a per-slot state
  // stored by columns, rows as the table's), ring_cols [B]: sequence b's mass row
  // (summed over every head) becomes column ring_cols[b] of its ring (window_ring.h)
  Ring rg;
  at::Tensor cols_keep;
  if (ring.has_value()) {
    TORCH_CHECK(return_probs && (sum_heads || k_cache.size(2) == 1),
                "ring takes the mass summed over every head: return_probs and sum_heads");
    TORCH_CHECK(ring_total.has_value() && ring_cols.has_value(), "ring needs ring_total and ring_cols");
    const at::Tensor& v = *ring;
    const at::Tensor& tt = *ring_total;
    TORCH_CHECK(v.scalar_type() == at::kFloat && v.dim() == 3 && v.stride(2) == 1 &&
                    v.size(0) == t.size(0) && v.size(2) >= p.size(1),
                "ring must be [rows, a, >= NB*bs] float32 with contiguous slots, a row per table row");
    TORCH_CHECK(tt.scalar_type() == at::kFloat && tt.dim() == 3 && tt.stride(2) == 1 &&
                    tt.size(0) == t.size(0) && tt.size(1) == 3 && tt.size(2) >= p.size(1),
                "ring_total must be [rows, 3, >= NB*bs] float32 with contiguous slots");
    cols_keep = ring_cols->contiguous();
    TORCH_CHECK(cols_keep.scalar_type() == at::kLong && cols_keep.dim() == 1 &&
                    cols_keep.size(0) == q.size(0), "ring_cols must be [B] int64");
    const int64_t* cp = cols_keep.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b)
      TORCH_CHECK(cp[b] >= 0 && cp[b] < v.size(1), "ring column out of range");
    TORCH_CHECK(ring_shift >= 0 && ring_shift <= 60, "ring_shift out of range");
    rg = Ring{v.data_ptr<float>(), tt.data_ptr<float>(), cp, v.stride(0), v.stride(1),
              tt.stride(0), tt.stride(1), std::ldexp(1.0, static_cast<int>(ring_shift))};
  }
  at::Tensor sinks_keep;
  int64_t sk0 = 0;
  const float* sp = features_of(softcap, sinks, q.size(0), q.size(1), sinks_keep, sk0);
  TORCH_CHECK(heads == 1 || sk0 == 0, "a per-head call takes sinks as [Hq]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "paged_decode",
                                  [&] { decode<scalar_t>(q, k_cache, v_cache, t, p, qp, scale,
                                                         window, out, mp, kp, kr, sum_heads, rp,
                                                         ap, a0, rg, static_cast<float>(softcap),
                                                         sp, sk0, heads); });
  return {out, mass, kd};
}


// ---- Quantized pools (attention/quant.py) ---------------------------------------------
// Codes (int8, fp8 e4m3 or two int4 per byte) with fp16 scales per (slot, kv head,
// group). Each visible row is dequantized into a scratch row of fp32 as it is read, and
// the maths is the portable path's: only what the call reads is widened, never the pool.
struct QuantRows {
  const uint8_t *k, *v;      // codes: slot s's row starts at s * row_bytes
  const at::Half *ks, *vs;   // scales: slot s's start at s * Hkv * ng
  int64_t mode, ng, gs;      // 1 int8, 2 fp8 e4m3, 3 int4; groups per head, channels each
};

// fp8 e4m3 (the fn variant: no infinities) by its bits: 4 exponent bits, bias 7.
const float* fp8_table() {
  static const std::vector<float> lut = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                               : std::ldexp(static_cast<float>(8 + m), e - 10);
      t[b] = (b & 128) ? -mag : mag;
    }
    return t;
  }();
  return lut.data();
}

inline void dequant_row(const QuantRows& r, const uint8_t* codes, const at::Half* sc,
                        int64_t Hkv, int64_t D, float* dst) {
  if (r.mode == 3) {  // group by group: one scale conversion per 32 channels
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < r.ng; ++g) {
        const float s = static_cast<float>(sc[h * r.ng + g]);
        const uint8_t* c = codes + (h * D + g * r.gs) / 2;
        float* o = dst + h * D + g * r.gs;
#pragma omp simd
        for (int64_t x = 0; x < r.gs / 2; ++x) {
          o[2 * x] = static_cast<float>((c[x] & 15) - 8) * s;
          o[2 * x + 1] = static_cast<float>((c[x] >> 4) - 8) * s;
        }
      }
    return;
  }
  const float* lut = fp8_table();
  for (int64_t h = 0; h < Hkv; ++h) {
    const float s = static_cast<float>(sc[h]);
    const uint8_t* c = codes + h * D;
    float* o = dst + h * D;
    if (r.mode == 1) {
#pragma omp simd
      for (int64_t x = 0; x < D; ++x) o[x] = static_cast<float>(static_cast<int8_t>(c[x])) * s;
    } else {
      for (int64_t x = 0; x < D; ++x) o[x] = lut[c[x]] * s;
    }
  }
}

void decode_seq_quant(const Batch<uint8_t>& a, const QuantRows& r, int64_t b, Scratch& w) {
  float* buf = w.tmp.data();
  const int64_t rl = a.row_len, sr = a.Hkv * r.ng;
  decode_seq_rows(a, b, w, [&](const uint8_t* base, int64_t phys) {
    const at::Half* scales = (base == r.k ? r.ks : r.vs) + phys / rl * sr;
    dequant_row(r, base + phys, scales, a.Hkv, a.D, buf);
    return static_cast<const float*>(buf);
  });
}

// int8 / fp8 codes (one scale per slot and kv head) on the vector path, when it takes
// this head dim: the same Batch over the same bytes, read as codes of that type.
template <typename TC>
bool vector_codes_as(const Batch<uint8_t>& a, const QuantRows& r, float sfac) {
  Batch<TC> c{a.io, reinterpret_cast<const TC*>(a.k), reinterpret_cast<const TC*>(a.v), a.mass,
              a.table, a.slot_pos, a.q_pos, a.B, a.Hq, a.Hkv, a.G, a.D, a.bs, a.NB, a.S,
              a.row_len, a.window, a.ms0, a.ts, a.ps, r.ks, r.vs, a.Hkv, sfac};
  c.rows = a.rows;
  c.rh = a.rh;
  c.softcap = a.softcap;
  c.sinks = a.sinks;
  c.sk0 = a.sk0;
  c.skh = a.skh;
  const SeqFn<TC> seq = vector_seq(c);
  if (seq == nullptr) return false;
  run(c, seq);
  return true;
}

bool vector_codes(const Batch<uint8_t>& a, const QuantRows& r, int64_t mode) {
  return mode == 1 ? vector_codes_as<int8_t>(a, r, 1.f) : vector_codes_as<Fp8>(a, r, 256.f);
}

std::vector<at::Tensor> paged_decode_quant(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& v_codes,
    const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& table,
    const at::Tensor& slot_pos, const at::Tensor& q_pos, double scale, int64_t window,
    bool return_probs, int64_t mode, const std::optional<at::Tensor>& rows, double softcap,
    const std::optional<at::Tensor>& sinks, int64_t heads) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with unit last stride");
  TORCH_CHECK(is_float_type(q.scalar_type()), "q must be a float tensor");
  TORCH_CHECK(mode >= 1 && mode <= 3, "mode must be 1 (int8), 2 (fp8 e4m3) or 3 (int4)");
  for (const auto* t : {&k_codes, &v_codes})
    TORCH_CHECK(t->scalar_type() == at::kByte && t->is_contiguous() && t->dim() == 4,
                "codes must be contiguous uint8 [N, bs, Hkv, Dp]");
  for (const auto* t : {&k_scale, &v_scale})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 4,
                "scales must be contiguous float16 [N, bs, Hkv, groups]");
  const int64_t Hkv = k_codes.size(2), NB = table.size(1), ng = k_scale.size(3);
  TORCH_CHECK(q.size(1) % Hkv == 0, "query heads must be a multiple of kv heads");
  // the call's rows, and query heads a row: as paged_decode's (`heads`)
  const int64_t B = q.size(0) * row_heads(q, heads, Hkv), Hq = q.size(1) / heads, D = q.size(2);
  const int64_t bs = k_codes.size(1);
  TORCH_CHECK(k_codes.size(3) == (mode == 3 ? D / 2 : D) && ng > 0 && D % ng == 0,
              "codes and scales do not match the head dim");
  TORCH_CHECK(table.scalar_type() == at::kLong && slot_pos.scalar_type() == at::kLong &&
                  q_pos.scalar_type() == at::kLong, "table, slot_pos and q_pos must be int64");
  const at::Tensor t = rows_of(table), p = rows_of(slot_pos), qp = q_pos.contiguous();
  TORCH_CHECK(t.dim() == 2 && p.dim() == 2 && p.size(0) == t.size(0) && p.size(1) == NB * bs &&
                  qp.numel() == q.size(0), "slot_pos must be [B, NB*bs] and q_pos [B]");
  at::Tensor rows_keep;
  const int64_t* rp = table_rows(rows, q.size(0), heads, t.size(0), rows_keep);
  at::Tensor out = at::empty({q.size(0), q.size(1), D}, q.options());
  at::Tensor mass = return_probs ? team::zeros({B, Hkv, p.size(1)}, q.options().dtype(at::kFloat))
                                 : at::empty({0}, q.options().dtype(at::kFloat));
  const QueryIO io = query_io(q, out, scale, heads);
  const int64_t rl = Hkv * k_codes.size(3);
  Batch<uint8_t> a{io, k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
                   return_probs ? mass.data_ptr<float>() : nullptr,
                   t.data_ptr<int64_t>(), p.data_ptr<int64_t>(), qp.data_ptr<int64_t>(),
                   B, Hq, Hkv, Hq / Hkv, D, bs, NB, NB * bs, rl, window,
                   Hkv * NB * bs, t.stride(0), p.stride(0)};
  a.rows = rp;
  a.rh = t.size(0) / heads;
  at::Tensor sinks_keep;
  a.sinks = features_of(softcap, sinks, q.size(0), q.size(1), sinks_keep, a.sk0);
  TORCH_CHECK(heads == 1 || a.sk0 == 0, "a per-head call takes sinks as [Hq]");
  a.skh = Hq;
  a.softcap = static_cast<float>(softcap);
  const QuantRows r{a.k, a.v, k_scale.data_ptr<at::Half>(), v_scale.data_ptr<at::Half>(),
                    mode, ng, D / ng};
  if (mode != 3 && vector_codes(a, r, mode)) return {out, mass};
  fp8_table();  // built once, before the threads
  const int64_t S = a.S;
  team::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    Scratch w{std::vector<int64_t>(S), std::vector<int64_t>(S), std::vector<float>(Hq * D),
              std::vector<float>(Hq * (S + 16)), std::vector<float>(Hkv * D + Hq * (D + 1))};
    for (int64_t b = begin; b < end; ++b) decode_seq_quant(a, r, b, w);
  });
  return {out, mass};
}

// A prompt chunk causal over its own keys (causal_prefill.h) and, given the pool
// (k_cache/v_cache [blocks, bs, Hkv, D] of q's dtype) with the sequence's table [NB] and
// slot_pos [NB * bs] (this layer's rows) and the chunk's first position `start`, over every
// visible slot before it (0 <= position < start: a cached prefix, holes and all):
// q [T, Hq, D], k/v [T, Hkv, D] (rows strided, heads and channels contiguous: the views of
// a fused qkv output), all fp32 or all bf16, D 16/32/64/128 -> [T, Hq, D] contiguous:
// `out` when given (the caller's rows of a whole step's output; copying a new tensor
// into them ran on torch's OpenMP threads past 32,768 elements, a wake-up per layer and
// prompt where a server lets them sleep).
// `fma`: bf16 widened into fp32's loop rather than by bf16 dot products (Intel's cores,
// `pair_fma`); fp32, and builds without AVX512-BF16, take fp32's loop either way.
// `softcap` (0: none) and `sinks` ([Hq] float32): the attention variants, as paged_decode's.
// AVX-512 builds only (`paged_decode_isa` "avx512"); elsewhere SDPA runs it.
at::Tensor causal_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                          const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& slot_pos,
                          int64_t start, const std::optional<at::Tensor>& into, bool fma,
                          double softcap, const std::optional<at::Tensor>& sinks) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() &&
                  q.size(0) == k.size(0) && q.size(2) == k.size(2) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0 && k.scalar_type() == dt && v.scalar_type() == dt &&
                  (dt == at::kFloat || dt == at::kBFloat16),
              "causal_prefill takes q [T, Hq, D] and k, v [T, Hkv, D] of one dtype (fp32 or bf16), "
              "Hq a multiple of Hkv");
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && (x->stride(1) == x->size(2) || x->size(1) == 1),
                "causal_prefill: each row's heads and channels contiguous");
  const int64_t t = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const bool cached = k_cache.has_value();
  TORCH_CHECK(cached == v_cache.has_value() && cached == table.has_value() && cached == slot_pos.has_value(),
              "causal_prefill: a prefix needs k_cache, v_cache, table and slot_pos together");
  std::vector<int64_t> prefix;  // the pool rows of the visible slots before `start`
  int64_t sp = 0;
  if (cached) {
    const at::Tensor &kc = *k_cache, &vc = *v_cache, &tb = *table, &pos = *slot_pos;
    TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.scalar_type() == dt && vc.scalar_type() == dt &&
                    kc.is_contiguous() && vc.is_contiguous() && kc.size(2) == hkv && kc.size(3) == d,
                "causal_prefill: k_cache and v_cache must be contiguous [blocks, bs, Hkv, D] of q's dtype");
    TORCH_CHECK(tb.dim() == 1 && pos.dim() == 1 && tb.scalar_type() == at::kLong && pos.scalar_type() == at::kLong &&
                    pos.size(0) <= tb.size(0) * kc.size(1),
                "causal_prefill: table [NB] and slot_pos [<= NB * bs], int64");
    const int64_t bs = kc.size(1), nb = kc.size(0);
    const at::Tensor tc = tb.contiguous(), pc = pos.contiguous();
    const int64_t *tp = tc.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>();
    for (int64_t s = 0; s < pc.size(0); ++s) {
      const int64_t block = tp[s / bs];
      if (pp[s] >= 0 && pp[s] < start && block >= 0) {
        TORCH_CHECK(block < nb, "causal_prefill: a table entry past the pool");
        prefix.push_back(block * bs + s % bs);
      }
    }
    sp = hkv * d;
  }
  if (into.has_value())
    TORCH_CHECK(into->sizes() == q.sizes() && into->scalar_type() == dt && into->is_contiguous() &&
                    into->data_ptr() != q.data_ptr(),
                "causal_prefill: out must be a contiguous [T, Hq, D] of q's dtype, apart from q");
  at::Tensor out = into.has_value() ? *into : at::empty({t, hq, d}, q.options());
  at::Tensor sinks_keep;  // [hq] only: the op runs one sequence
  int64_t sk0 = 0;
  const float* sinks_p = features_of(softcap, sinks, 1, hq, sinks_keep, sk0);
  TORCH_CHECK(sk0 == 0, "causal_prefill: sinks must be [Hq]");
#if defined(KVSERVE_AVX512)
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128, "causal_prefill: head dim 16, 32, 64 or 128");
  if (t == 0) return out;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* pk = cached ? k_cache->data_ptr<T>() : nullptr;
    const T* pv = cached ? v_cache->data_ptr<T>() : nullptr;
    auto one = [&](auto dim, auto pairs) {
      prefill::causal<T, decltype(dim)::value, decltype(pairs)::value>(
          q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), t, hq, hkv, q.stride(0), k.stride(0),
          v.stride(0), static_cast<float>(scale), out.data_ptr<T>(), pk, pv, sp, prefix.data(),
          static_cast<int64_t>(prefix.size()), static_cast<float>(softcap), sinks_p);
    };
    auto dims = [&](auto pairs) {
      if (d == 16) one(std::integral_constant<int, 16>{}, pairs);
      else if (d == 32) one(std::integral_constant<int, 32>{}, pairs);
      else if (d == 64) one(std::integral_constant<int, 64>{}, pairs);
      else one(std::integral_constant<int, 128>{}, pairs);
    };
#if defined(KVSERVE_CAUSAL_BF16_DOT)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (!fma) return dims(std::true_type{});
    }
#endif
    dims(std::false_type{});
  };
  if (dt == at::kFloat) run(float{}); else run(c10::BFloat16{});
  return out;
#else
  TORCH_CHECK(false, "causal_prefill needs an AVX-512 build");
#endif
}

// The vector path this build takes for the usual head dims (`vector_seq`).
std::string paged_decode_isa() {
#if defined(KVSERVE_AVX512)
  return "avx512";
#elif defined(KVSERVE_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}
}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor slot_pos, "
        "Tensor q_pos, float scale, int window, bool return_probs, Tensor? key_diversity=None, "
        "bool sum_heads=False, Tensor? rows=None, Tensor(a!)? acc=None, Tensor(b!)? ring=None, "
        "Tensor(c!)? ring_total=None, Tensor? ring_cols=None, int ring_shift=0, float softcap=0., "
        "Tensor? sinks=None, int heads=1) -> Tensor[]");
  m.def("paged_decode_quant(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scale, "
        "Tensor v_scale, Tensor table, Tensor slot_pos, Tensor q_pos, float scale, int window, "
        "bool return_probs, int mode, Tensor? rows=None, float softcap=0., Tensor? sinks=None, "
        "int heads=1) -> Tensor[]");
  m.def("paged_decode_isa() -> str");
  m.def("causal_prefill(Tensor q, Tensor k, Tensor v, float scale, Tensor? k_cache=None, Tensor? v_cache=None, "
        "Tensor? table=None, Tensor? slot_pos=None, int start=0, Tensor(a!)? out=None, bool fma=False, "
        "float softcap=0., Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_quant", &paged_decode_quant);
  m.impl("causal_prefill", &causal_prefill);
}

// No tensor argument to dispatch on: registered as a catch-all.
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.impl("paged_decode_isa", &paged_decode_isa);
}
