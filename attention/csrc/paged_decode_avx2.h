// The decode kernel's vector path on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3,
// Intel before Skylake-SP, most small cloud instances). Included by paged_decode_cpu.cpp
// inside its namespace, after `Batch`, `Scratch`, `visible_slots`, `write_mass`,
// `prefetch` and `touch`; the contract (inputs, outputs, mass rows) is that file's.
//
// Why its own path: without it these CPUs ran the portable loop, a dot product and a
// std::exp per (slot, head) and a widened copy of every row: on a Zen 3 host the 3m
// model's attention was ~45% of a 64-sequence decode step. The shape follows the
// AVX-512 path, at 8 lanes: scores 8 slots at a time (one accumulator per slot, reduced
// to a vector of 8 scores by a tree of horizontal adds: AVX2 has no cheap cross-lane
// folds), the softmax's exp as the same polynomial (2^n through the exponent bits, which
// equals AVX-512's scalef for the normal results the clamp guarantees), and the V pass
// with a GQA group's output rows in registers. 16-bit K rows are widened once per tile
// into `Scratch::rows` and read there by every query head of the tile.

using keydiff::load8;  // key_diversity.h's 8-lane helpers: one copy
using keydiff::hsum8;
using keydiff::sum8x8;

// exp for x <= 0: exp512's polynomial and clamp (see there); 2^n by the exponent bits.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // n in [-126, 0]: 2^n is the normal float whose exponent field is n + 127
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// cap512's soft-capping at 8 lanes (see there): cap * tanh(x / cap) through exp256.
inline __m256 cap256(__m256 x, __m256 cap, __m256 inv_cap) {
  const __m256 y = _mm256_mul_ps(x, inv_cap);
  const __m256 sign = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
  const __m256 t = exp256(_mm256_mul_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
  return _mm256_mul_ps(cap, _mm256_or_ps(th, sign));
}

// soft-capping of n scores in place, 8 at a time (the tail one by one)
inline void soft_cap(float* x, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap), ic = _mm256_set1_ps(1.f / cap);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, cap256(_mm256_loadu_ps(x + i), c, ic));
  for (; i < n; ++i) x[i] = cap_score(x[i], cap);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// One sequence, head dim D = 8 * NV; in the V pass GC query heads share each V load
// and the output rows are summed CH vectors (a D chunk) at a time, GC * CH <= 8
// accumulators: with one FMA per accumulator a slot, eight of them cover the latency.
template <typename TKV, int NV, int GC>
void decode_seq_avx2(const Batch<TKV>& a, int64_t b, Scratch& w) {
  constexpr int64_t D = 8 * NV;
  constexpr int CH = NV < 8 ? NV : 8;
  const int64_t Hq = a.Hq, G = a.G, rl = a.row_len;
  const int64_t n = visible_slots(a, b, w.phys.data(), w.logical.data());
  if (n == 0) return a.io.zero(b);
  float* qf = w.qf.data();  // [Hq][D], scaled
  a.io.read(b, qf);
  const int64_t np = (n + 7) / 8 * 8;  // score rows padded to whole tiles
  float* sc = w.sc.data();             // [Hq][np]
  const int64_t* phys = w.phys.data();
  const int64_t row_bytes = rl * sizeof(TKV);
  const int64_t v_ahead = n * row_bytes <= (256 << 10) ? row_bytes : 0;  // as AVX-512's
  for (int64_t t = 0; t < np; t += 8) {
    for (int s = 0; s < 8; ++s) {  // the next tile's rows
      const int64_t next = phys[std::min(t + 8 + s, n - 1)];
      if (a.stream)
        touch(a.k + next, row_bytes);
      else
        prefetch(a.k + next, row_bytes);
      prefetch<2>(a.v + next, v_ahead);
    }
    const float* rows[8];  // a short last tile repeats its last slot; those lanes masked
    for (int s = 0; s < 8; ++s) {
      const TKV* src = a.k + phys[std::min(t + s, n - 1)];
      if constexpr (std::is_same_v<TKV, float>) {
        rows[s] = src;
      } else {
        // the call's kv heads only: a head slice (`head_slice`) starts its rows at its
        // first head, and the row's rest belongs to the other slices
        float* dst = w.rows.data() + s * rl;
        for (int64_t x = 0; x < a.Hkv * D; x += 8) _mm256_storeu_ps(dst + x, load8(src + x));
        rows[s] = dst;
      }
    }
    const __m256 dead = _mm256_cmp_ps(
        _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
        _mm256_set1_ps(static_cast<float>(n - t)), _CMP_GE_OQ);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const float* qh = qf + hq * D;
      const int64_t off = hq / G * D;
      __m256 acc[8];
      for (int s = 0; s < 8; ++s) {
        const float* k = rows[s] + off;
        acc[s] = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(k));
        for (int j = 1; j < NV; ++j)
          acc[s] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * j), _mm256_loadu_ps(k + 8 * j), acc[s]);
      }
      // masked lanes: exp gives ~0, and they are never read
      _mm256_storeu_ps(sc + hq * np + t,
                       _mm256_blendv_ps(sum8x8(acc), _mm256_set1_ps(-1e30f), dead));
    }
  }
  for (int64_t i = 0; i < std::min<int64_t>(n, 8); ++i) prefetch(a.v + phys[i], row_bytes);
  if (a.softcap > 0.f)  // the live lanes only: the padding's -1e30 must stay out of the sum
    for (int64_t hq = 0; hq < Hq; ++hq) soft_cap(sc + hq * np, n, a.softcap);
  float* inv = w.tmp.data();  // 1 / softmax denominator per query head
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* row = sc + hq * np;
    __m256 mx = _mm256_loadu_ps(row);
    for (int64_t t = 8; t < np; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + t));
    float m = hmax8(mx);
    if (a.sinks != nullptr) m = std::max(m, a.sink(b, hq));  // the sink joins max and sum
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < np; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + t), mv));
      _mm256_storeu_ps(row + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    if (a.sinks != nullptr) total += std::exp(a.sink(b, hq) - m);
    inv[hq] = 1.f / total;
  }
  // Weighted V rows, PT slots at a time so that the tile's rows stay in L1 while each
  // kv head's part (and each D chunk of it) is read.
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
      for (int64_t g = 0; g < G; g += GC, hq += GC) {
        for (int c0 = 0; c0 < NV; c0 += CH) {
          const TKV* vh = a.v + h * D + 8 * c0;
          __m256 acc[GC][CH];
          for (int c = 0; c < GC; ++c)
            for (int x = 0; x < CH; ++x) acc[c][x] = _mm256_loadu_ps(ob + (hq + c) * D + 8 * (c0 + x));
          for (int64_t i = t0; i < t1; ++i) {
            __m256 v[CH];
            for (int x = 0; x < CH; ++x) v[x] = load8(vh + phys[i] + 8 * x);
            for (int c = 0; c < GC; ++c) {
              const __m256 p = _mm256_set1_ps(sc[(hq + c) * np + i]);
              for (int x = 0; x < CH; ++x) acc[c][x] = _mm256_fmadd_ps(p, v[x], acc[c][x]);
            }
          }
          for (int c = 0; c < GC; ++c)
            for (int x = 0; x < CH; ++x) _mm256_storeu_ps(ob + (hq + c) * D + 8 * (c0 + x), acc[c][x]);
        }
      }
    }
  }
  a.io.write(b, ob, inv);
  if (a.mass != nullptr) write_mass(a, b, w.logical.data(), n, sc, np, inv);
}

// Query heads sharing a V load: as many as fill 8 accumulators with a D chunk of up to 8
// vectors (4 at d = 16, 2 at d = 32, 1 from d = 64), where they divide the GQA group.
template <typename TKV, int NV>
SeqFn<TKV> pick_seq_avx2(int64_t G) {
  constexpr int CH = NV < 8 ? NV : 8, GC = 8 / CH;
  if (GC >= 4 && G % 4 == 0) return decode_seq_avx2<TKV, NV, GC >= 4 ? 4 : 1>;
  if (GC >= 2 && G % 2 == 0) return decode_seq_avx2<TKV, NV, GC >= 2 ? 2 : 1>;
  return decode_seq_avx2<TKV, NV, 1>;
}
