// Causal attention of a prompt chunk over its own keys and, where the chunk follows a
// cached prefix (a prefix-cache hit, a long prompt's later chunk), over the prefix's keys
// in the pool, for AVX-512 CPUs: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], on
// kvserve's thread team. Included by paged_decode_cpu.cpp inside its AVX-512 section
// (its exp512 and load16).
//
// Why: torch's fused CPU SDPA (`is_causal`) ran 500-token prefills of the 160M model at
// ~44 GFLOP/s in bf16 (25% of the prefill) and ~90 in fp32 (15% at 1,000 tokens), on
// torch's OpenMP threads, which sleep in a server (`--cpu-wait poll`).
//
// How (FlashAttention's online softmax, arXiv 2205.14135, Alg. 1, with a CPU's tiles): a
// job is 16 queries of one head, one query a vector lane, against its kv head's keys 16
// at a time. The queries are stored transposed (qt [D][16], scaled), so a key chunk's 16
// rows of scores are 16 accumulators, each d one load of qt and 16 FMAs whose key value
// is broadcast from memory; the softmax runs across keys lane by lane (a max, exp512 and
// a sum per key row, no horizontal reduction); the output accumulates transposed too
// (ot [D][16]), eight d rows at a time, each a broadcast value of V times a row of
// probabilities. Keys past a query are masked on the diagonal chunk only. K and V are
// first widened to fp32, one [T rounded up to 16, D] block per kv head (zero rows past T),
// so that bf16 and fp32 take the same loop and a tail needs no other path.
//
// A cached prefix's visible rows (read from the pool's blocks where they lie) go in front
// of the chunk's, padded at the front to whole chunks of 16 (`pad` empty rows, masked for
// every query), so that each query block's diagonal chunk stays aligned: query i's own key
// is row `pre` + i. Why: a chunk after a prefix went through the torch path, which gathers
// every block into a padded copy and runs SDPA under a mask (profiled on AMD Zen 4 before
// commit cb6f198: a gather 14% and SDPA 15% of such a step).
//
// bf16 inputs where the CPU has bf16 dot products (AVX512-BF16: Zen 4, Cooper Lake on):
// the scores come from `vdpbf16ps` over the unscaled bf16 q and K in pairs of channels
// (exact products summed in fp32, as the widened FMAs sum them but for the pairing; the
// scale applied to each score after), half the instructions of the fp32 FMAs and K copied
// unwidened. The weighted values likewise: each chunk's probabilities are rounded to bf16
// in pairs of keys, and V is copied in pairs of rows (two keys' bf16 values side by side
// a channel), so that each `vdpbf16ps` adds two keys' terms to 16 queries' output channel:
// half the instructions of the fp32 FMAs over widened V. torch's CPU flash attention
// rounds its probabilities to bf16 for the same product (FlashAttentionKernel.cpp,
// `qk_reduced_data`); the softmax's denominator sums them unrounded, as it does. Not on
// Intel (the op's `fma`, native/build.py `pair_fma`): its cores run `vdpbf16ps` at half
// the rate of their two FMA units, and bf16 widened to fp32's loop was 1.25-1.6x as fast
// (a Xeon, one layer of the 160M model, 128-2,048 tokens; commit 57bae56).
//
// Attention variants (paged_decode_cpu.cpp's): Gemma 2's soft-capping (`CAP`, a template
// flag, so the plain loop is the same code: each chunk's scores become cap * tanh(s / cap)
// before the masks) and gpt-oss's learned sinks, which cost nothing in the loop: the
// online softmax starts from the sink (max = sink, denominator = 1, no value) instead of
// from nothing.
#pragma once

#include <type_traits>

#if defined(__AVX512BF16__)
#define KVSERVE_CAUSAL_BF16_DOT 1
#endif

namespace prefill {

constexpr int64_t kL = 16;  // queries a job (one a lane) and keys a chunk

// One job: queries i0..i0+15 of a head (qt [D][16], scaled; lanes past T are zero) against
// keys 0..pre+i0+15 of their kv head (kf/vf [>= pre + i0 + 16][D] fp32): `pre` rows of a
// cached prefix (the first `pad` of them empty), then the chunk's own. ot [D][16] gets the
// normalised output, transposed. QK uint32_t: qt holds bf16 pairs of channels [D/2][16],
// unscaled, and kf the keys' bf16 pairs [rows][D/2]; each score is multiplied by `scale`
// (float: qt comes scaled, `scale` unused).
// PADDED: pad > 0 (a prefix not a whole number of chunks; without it the masks of the
// padding cost the fp32 loop 3-12%). CAP: scores soft-capped at `cap`. The softmax starts
// from max m0 and denominator l0: -1e30 and 0, or a sink logit and 1.
template <int D, typename QK, bool PADDED, bool CAP>
inline void attend_block(const QK* qt, const QK* kf, const QK* vf, int64_t i0, int64_t pre,
                         int pad, float* ot, float scale, float cap, float m0, float l0) {
  for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(ot + d * kL, _mm512_setzero_ps());
  __m512 m = _mm512_set1_ps(m0), l = _mm512_set1_ps(l0);
  __m512 s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15;
#define KVSERVE_KEYS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
  for (int64_t j0 = 0; j0 <= pre + i0; j0 += kL) {
#define KVSERVE_ZERO(j) s##j = _mm512_setzero_ps();
    KVSERVE_KEYS(KVSERVE_ZERO)
    if constexpr (std::is_same_v<QK, float>) {
      const float* kc = kf + j0 * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 qd = _mm512_loadu_ps(qt + d * kL);
#define KVSERVE_SCORE(j) s##j = _mm512_fmadd_ps(_mm512_set1_ps(kc[j * D + d]), qd, s##j);
        KVSERVE_KEYS(KVSERVE_SCORE)
      }
    } else {
#if defined(KVSERVE_CAUSAL_BF16_DOT)
      const QK* kc = kf + j0 * (D / 2);
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        const __m512i qd = _mm512_loadu_si512(qt + dp * kL);
        // the key's pair broadcast inside the instruction, as linear_panels.h's tile does
#define KVSERVE_DOT(j) asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(s##j) : "m"(kc[j * (D / 2) + dp]), "v"(qd));
        KVSERVE_KEYS(KVSERVE_DOT)
#undef KVSERVE_DOT
      }
      const __m512 sc = _mm512_set1_ps(scale);
#define KVSERVE_SCALE(j) s##j = _mm512_mul_ps(s##j, sc);
      KVSERVE_KEYS(KVSERVE_SCALE)
#undef KVSERVE_SCALE
#endif
    }
    if constexpr (CAP) {
      const __m512 c = _mm512_set1_ps(cap), ic = _mm512_set1_ps(1.0f / cap);
#define KVSERVE_CAP(j) s##j = cap512(s##j, c, ic);
      KVSERVE_KEYS(KVSERVE_CAP)
#undef KVSERVE_CAP
    }
    const bool diagonal = j0 == pre + i0;  // key j0 + j is past query i0 + lane where lane < j
    const bool lead = PADDED && j0 == 0;  // keys j < pad: the prefix's empty front rows
#define KVSERVE_MASK(j) if (diagonal) s##j = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), \
                                                                static_cast<__mmask16>(0xFFFFu << j), s##j); \
    if (lead && j < pad) s##j = _mm512_set1_ps(-1e30f);
    KVSERVE_KEYS(KVSERVE_MASK)
    const __m512 mx = _mm512_max_ps(
        _mm512_max_ps(_mm512_max_ps(_mm512_max_ps(s0, s1), _mm512_max_ps(s2, s3)),
                      _mm512_max_ps(_mm512_max_ps(s4, s5), _mm512_max_ps(s6, s7))),
        _mm512_max_ps(_mm512_max_ps(_mm512_max_ps(s8, s9), _mm512_max_ps(s10, s11)),
                      _mm512_max_ps(_mm512_max_ps(s12, s13), _mm512_max_ps(s14, s15))));
    const __m512 mnew = _mm512_max_ps(m, mx);
    const __m512 alpha = exp512(_mm512_sub_ps(m, mnew));
    m = mnew;
    // masked keys' probabilities are exactly zero (exp512 clamps at e^-87, not 0)
#define KVSERVE_PROB(j) s##j = exp512(_mm512_sub_ps(s##j, mnew)); \
    if (diagonal) s##j = _mm512_maskz_mov_ps(static_cast<__mmask16>(0xFFFFu << j), s##j); \
    if (lead && j < pad) s##j = _mm512_setzero_ps();
    KVSERVE_KEYS(KVSERVE_PROB)
    l = _mm512_fmadd_ps(l, alpha,
        _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)),
                          _mm512_add_ps(_mm512_add_ps(s4, s5), _mm512_add_ps(s6, s7))),
            _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s8, s9), _mm512_add_ps(s10, s11)),
                          _mm512_add_ps(_mm512_add_ps(s12, s13), _mm512_add_ps(s14, s15)))));
#if defined(KVSERVE_CAUSAL_BF16_DOT)
    if constexpr (!std::is_same_v<QK, float>) {
      // the probabilities in pairs of keys: lane q holds keys 2p and 2p + 1 of query q
      // (cvtne2ps puts key 2p's 16 queries in words 0-15 and key 2p + 1's in 16-31)
      const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                             23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#define KVSERVE_PAIR(a, b) _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(b, a))
      const __m512i p0 = KVSERVE_PAIR(s0, s1), p1 = KVSERVE_PAIR(s2, s3), p2 = KVSERVE_PAIR(s4, s5),
                    p3 = KVSERVE_PAIR(s6, s7), p4 = KVSERVE_PAIR(s8, s9), p5 = KVSERVE_PAIR(s10, s11),
                    p6 = KVSERVE_PAIR(s12, s13), p7 = KVSERVE_PAIR(s14, s15);
#undef KVSERVE_PAIR
      const QK* vc = vf + j0 / 2 * D;  // [8 key pairs][D] pairs of values
      for (int64_t d = 0; d < D; d += 8) {
        __m512 o[8];
        for (int x = 0; x < 8; ++x) o[x] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + x) * kL), alpha);
#define KVSERVE_PV(jp)                                                                     \
  for (int x = 0; x < 8; ++x)                                                              \
    asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(o[x]) : "m"(vc[jp * D + d + x]), "v"(p##jp));
        KVSERVE_PV(0) KVSERVE_PV(1) KVSERVE_PV(2) KVSERVE_PV(3)
        KVSERVE_PV(4) KVSERVE_PV(5) KVSERVE_PV(6) KVSERVE_PV(7)
#undef KVSERVE_PV
        for (int x = 0; x < 8; ++x) _mm512_storeu_ps(ot + (d + x) * kL, o[x]);
      }
      continue;
    }
#endif
    const float* vc = reinterpret_cast<const float*>(vf) + j0 * D;
    // eight output rows at a time: eight independent FMA chains over the 16 keys
    for (int64_t d = 0; d < D; d += 8) {
      __m512 o0 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 0) * kL), alpha);
      __m512 o1 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 1) * kL), alpha);
      __m512 o2 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 2) * kL), alpha);
      __m512 o3 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 3) * kL), alpha);
      __m512 o4 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 4) * kL), alpha);
      __m512 o5 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 5) * kL), alpha);
      __m512 o6 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 6) * kL), alpha);
      __m512 o7 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 7) * kL), alpha);
#define KVSERVE_VALUE(j)                                                    \
  {                                                                         \
    const float* vj = vc + j * D + d;                                       \
    o0 = _mm512_fmadd_ps(_mm512_set1_ps(vj[0]), s##j, o0);                  \
    o1 = _mm512_fmadd_ps(_mm512_set1_ps(vj[1]), s##j, o1);                  \
    o2 = _mm512_fmadd_ps(_mm512_set1_ps(vj[2]), s##j, o2);                  \
    o3 = _mm512_fmadd_ps(_mm512_set1_ps(vj[3]), s##j, o3);                  \
    o4 = _mm512_fmadd_ps(_mm512_set1_ps(vj[4]), s##j, o4);                  \
    o5 = _mm512_fmadd_ps(_mm512_set1_ps(vj[5]), s##j, o5);                  \
    o6 = _mm512_fmadd_ps(_mm512_set1_ps(vj[6]), s##j, o6);                  \
    o7 = _mm512_fmadd_ps(_mm512_set1_ps(vj[7]), s##j, o7);                  \
  }
      KVSERVE_KEYS(KVSERVE_VALUE)
      _mm512_storeu_ps(ot + (d + 0) * kL, o0);
      _mm512_storeu_ps(ot + (d + 1) * kL, o1);
      _mm512_storeu_ps(ot + (d + 2) * kL, o2);
      _mm512_storeu_ps(ot + (d + 3) * kL, o3);
      _mm512_storeu_ps(ot + (d + 4) * kL, o4);
      _mm512_storeu_ps(ot + (d + 5) * kL, o5);
      _mm512_storeu_ps(ot + (d + 6) * kL, o6);
      _mm512_storeu_ps(ot + (d + 7) * kL, o7);
    }
  }
#undef KVSERVE_KEYS
#undef KVSERVE_ZERO
#undef KVSERVE_SCORE
#undef KVSERVE_MASK
#undef KVSERVE_PROB
#undef KVSERVE_VALUE
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);  // every lane saw its own key (l > 0)
  for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(ot + d * kL, _mm512_mul_ps(_mm512_loadu_ps(ot + d * kL), inv));
}

// The op's body for one input dtype T (float or c10::BFloat16) and head dim D. `pool_k` /
// `pool_v` ([rows, Hkv, D], rows `sp` apart) and `prefix` (P pool rows, in any order: a
// softmax's keys are a set) give the cached keys before the chunk; P = 0: none.
// kPairs: bf16 by `vdpbf16ps` (the op's caller decides: not where FMAs run at twice its
// rate, `pair_fma`); otherwise bf16 is widened and takes fp32's loop. `cap` > 0: scores
// soft-capped; `sinks` [hq] (or nullptr): each head's sink logit.
template <typename T, int D, bool kPairs>
void causal(const T* q, const T* k, const T* v, int64_t t, int64_t hq, int64_t hkv,
            int64_t sq, int64_t sk, int64_t sv, float scale, T* out, const T* pool_k = nullptr,
            const T* pool_v = nullptr, int64_t sp = 0, const int64_t* prefix = nullptr, int64_t p = 0,
            float cap = 0.0f, const float* sinks = nullptr) {
#if defined(KVSERVE_CAUSAL_BF16_DOT)
  static_assert(!kPairs || std::is_same_v<T, c10::BFloat16>, "pairs are bf16's");
#else
  static_assert(!kPairs, "pairs need AVX512-BF16");
#endif
  const int64_t tp = (t + kL - 1) / kL * kL, g = hq / hkv, blocks = tp / kL;
  const int64_t pre = (p + kL - 1) / kL * kL, pad = pre - p, rows = pre + tp;
  // K and V widened to fp32, or for pairs as they are (bf16 bits): K a row at a time, V
  // in pairs of rows ([rows / 2][D][2]: rows 2i and 2i + 1 side by side a channel).
  // Zero rows: pad, past t.
  std::vector<float> kf(kPairs ? 0 : hkv * rows * D), vf(kPairs ? 0 : hkv * rows * D);
  std::vector<uint16_t> kb(kPairs ? hkv * rows * D : 0), vb(kPairs ? hkv * rows * D : 0);
  team::parallel_for(0, hkv * (rows / kL), 1, [&](int64_t b, int64_t e) {
    for (int64_t x = b; x < e; ++x) {
      const int64_t h = x / (rows / kL), r0 = x % (rows / kL) * kL;
      for (int64_t r = std::max(r0, pad); r < std::min(r0 + kL, pre + t); ++r) {
        const T* kr = (r < pre ? pool_k + prefix[r - pad] * sp : k + (r - pre) * sk) + h * D;
        const T* vr = (r < pre ? pool_v + prefix[r - pad] * sp : v + (r - pre) * sv) + h * D;
        if constexpr (kPairs) {
          std::memcpy(&kb[(h * rows + r) * D], kr, D * sizeof(T));
          // each value zero-extended into its channel's pair, shifted up for an odd row,
          // OR-ed in (vb starts zero; a pair's two rows lie in one job's chunk)
          uint32_t* vp = reinterpret_cast<uint32_t*>(&vb[(h * rows + (r & ~int64_t{1})) * D]);
          for (int64_t d = 0; d < D; d += 16) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + d)));
            if (r & 1) w = _mm512_slli_epi32(w, 16);
            _mm512_storeu_si512(vp + d, _mm512_or_si512(_mm512_loadu_si512(vp + d), w));
          }
        } else {
          for (int64_t d = 0; d < D; d += 16) {
            _mm512_storeu_ps(&kf[(h * rows + r) * D + d], load16(kr + d));
            _mm512_storeu_ps(&vf[(h * rows + r) * D + d], load16(vr + d));
          }
        }
      }
    }
  });
  // Jobs head by head, so that a thread's run of jobs reads one kv head's K and V (at
  // 2,048 fp32 rows of D 64, 1 MB: in L2) rather than every head's (12 MB); within a head
  // in an order whose halves cost alike (a job costs its block's index + 1 chunks): block
  // pairs (0, last), (1, last - 1), ...
  team::parallel_for(0, hq * blocks, 1, [&](int64_t b, int64_t e) {
    alignas(64) float qt[D * kL], ot[D * kL];
    alignas(64) uint32_t qp[D / 2 * kL];  // the pairs' q (unused in fp32)
    for (int64_t x = b; x < e; ++x) {
      const int64_t head = x / blocks, rank = x % blocks;
      const int64_t blk = rank % 2 == 0 ? rank / 2 : blocks - 1 - rank / 2;
      const int64_t i0 = blk * kL, n = std::min(kL, t - i0), h = head / g;
      const float m0 = sinks != nullptr ? sinks[head] : -1e30f, l0 = sinks != nullptr ? 1.0f : 0.0f;
      auto attend = [&](const auto* qv, const auto* kv) {  // the padding's masks only where needed
        using QK = std::remove_cv_t<std::remove_pointer_t<decltype(qv)>>;
        const QK* vv = kPairs ? reinterpret_cast<const QK*>(vb.data() + h * rows * D)
                              : reinterpret_cast<const QK*>(vf.data() + h * rows * D);
        const int pd = static_cast<int>(pad);
        if (cap > 0.0f) {
          if (pad > 0) attend_block<D, QK, true, true>(qv, kv, vv, i0, pre, pd, ot, scale, cap, m0, l0);
          else attend_block<D, QK, false, true>(qv, kv, vv, i0, pre, 0, ot, scale, cap, m0, l0);
        } else if (pad > 0) {
          attend_block<D, QK, true, false>(qv, kv, vv, i0, pre, pd, ot, scale, cap, m0, l0);
        } else {
          attend_block<D, QK, false, false>(qv, kv, vv, i0, pre, 0, ot, scale, cap, m0, l0);
        }
      };
      if constexpr (kPairs) {  // two channels' bf16 bits a lane, the lower channel low
        for (int64_t lane = 0; lane < kL; ++lane) {
          const T* qr = q + (i0 + lane) * sq + head * D;
          for (int64_t dp = 0; dp < D / 2; ++dp)
            qp[dp * kL + lane] = lane < n ? (static_cast<uint32_t>(qr[2 * dp + 1].x) << 16) | qr[2 * dp].x : 0u;
        }
        attend(static_cast<const uint32_t*>(qp), reinterpret_cast<const uint32_t*>(&kb[h * rows * D]));
      } else {
        for (int64_t lane = 0; lane < kL; ++lane)
          for (int64_t d = 0; d < D; ++d)
            qt[d * kL + lane] = lane < n ? static_cast<float>(q[(i0 + lane) * sq + head * D + d]) * scale : 0.0f;
        attend(static_cast<const float*>(qt), &kf[h * rows * D]);
      }
      for (int64_t lane = 0; lane < n; ++lane)
        for (int64_t d = 0; d < D; ++d) out[((i0 + lane) * hq + head) * D + d] = static_cast<T>(ot[d * kL + lane]);
    }
  });
}

}  // namespace prefill
