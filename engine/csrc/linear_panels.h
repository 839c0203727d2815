// A linear layer's GEMM over its weight laid out in panels of 16 output columns, for CPUs
// with AVX2 but without AVX-512, where it beats oneDNN at the row counts of decoding.
//
// Why: there (AMD Zen 1-3, Intel client cores) a decode step is bound by the weight bytes
// it streams, oneDNN's fp32 kernels stream them at ~70% of what this loop does for 1-12
// rows, and a bf16 weight had to be widened to fp32 for oneDNN (twice the bytes, kept beside
// the bf16 one: three times the memory). Measured on the 160M model's layers (Zen 3, two
// threads; docs/benchmarks.md, session 31): fp32 1.3-2x oneDNN's speed at 1-12 rows,
// 1.1-1.2x up to 64; bf16 2.1-3.4x at 1-12 rows, 1.2-1.9x up to 64; from 128 rows (prefill)
// 0.83-0.96x in both (where that goes is not found yet: not the block sizes).
//
// The layout is the one BLIS-style kernels pack their B operand into: panel p holds columns
// 16p..16p+15 of W^T, row after row of K ([ceil(N/16), K, 16], zero columns past N;
// engine/cpu_linear.py lays it out once at load). A tile of up to 6 rows x 16 columns
// lives in 12 of the 16 ymm registers: each k step loads 16 weights (a bf16 one widened
// in registers: the top half of an fp32) and broadcasts 6 inputs into 12 FMAs. Steps of up
// to `kWholeK` rows (decoding) run whole K in registers, streaming every weight once. Longer
// steps (prefill) work in blocks: `kMC` rows by `kKC` of K, copied so that a tile's inputs
// are adjacent (L2), against one panel's slice at a time (L1), as BLIS does.
//
// The products are the ones a GEMM makes, summed in fp32 in k order; a bf16 layer rounds
// once at the end (bias added in fp32 first), as a bf16 GEMM that accumulates in fp32 does.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../../kvpool/csrc/key_diversity.h"  // load8: 8 lanes of fp32 or widened bf16

namespace panels {

constexpr int64_t kNR = 16;   // columns a panel holds: two 8-lane registers
constexpr int64_t kMR = 6;    // rows of a register tile: 6 x 2 accumulators
constexpr int64_t kWholeK = 72;  // rows up to which a step is one block: weights stream once
constexpr int64_t kKC = 384;     // K of a longer step's block: 24 KB of an fp32 panel (L1)
constexpr int64_t kMC = 144;     // rows of a longer step's block: 216 KB of fp32 input (L2)

// c[r, 0:16] (+)= sum_k a[r * lda + k * ks] * b[k * 16 + 0:16] for the MR rows of a tile
// (ks 1: rows of the input; lda 1, ks MR: a block's copy, the tile's rows adjacent).
template <int MR, typename W>
inline void tile(const float* a, int64_t lda, int64_t ks, const W* b, int64_t kc, float* c, int64_t ldc,
                 bool accumulate) {
#ifdef KVSERVE_KEYDIFF_LANES8
  // Named registers, not arrays: GCC kept an accumulator array on the stack, storing all
  // 12 every k step (2.5x slower at 1,024 rows).
  using keydiff::load8;
  [[maybe_unused]] __m256 lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, lo4, hi4, lo5, hi5;
#define KVSERVE_PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define KVSERVE_PANEL_INIT(r)                                                          \
  if constexpr (r < MR) {                                                              \
    lo##r = accumulate ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();           \
    hi##r = accumulate ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();       \
  }
#define KVSERVE_PANEL_FMA(r)                                                           \
  if constexpr (r < MR) {                                                              \
    const __m256 ar = _mm256_broadcast_ss(a + r * lda + k * ks);                       \
    lo##r = _mm256_fmadd_ps(ar, b0, lo##r);                                            \
    hi##r = _mm256_fmadd_ps(ar, b1, hi##r);                                            \
  }
#define KVSERVE_PANEL_STORE(r)                                                         \
  if constexpr (r < MR) {                                                              \
    _mm256_storeu_ps(c + r * ldc, lo##r);                                              \
    _mm256_storeu_ps(c + r * ldc + 8, hi##r);                                          \
  }
  KVSERVE_PANEL_ROWS(KVSERVE_PANEL_INIT)
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = load8(b + k * kNR), b1 = load8(b + k * kNR + 8);
    KVSERVE_PANEL_ROWS(KVSERVE_PANEL_FMA)
  }
  KVSERVE_PANEL_ROWS(KVSERVE_PANEL_STORE)
#undef KVSERVE_PANEL_ROWS
#undef KVSERVE_PANEL_INIT
#undef KVSERVE_PANEL_FMA
#undef KVSERVE_PANEL_STORE
#else
  float acc[MR][kNR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNR; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : 0.0f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < kNR; ++j) acc[r][j] += a[r * lda + k * ks] * static_cast<float>(b[k * kNR + j]);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNR; ++j) c[r * ldc + j] = acc[r][j];
#endif
}

template <typename W>
inline void some_rows(int64_t mr, const float* a, int64_t lda, int64_t ks, const W* b, int64_t kc, float* c,
                      int64_t ldc, bool accumulate) {
  switch (mr) {
    case 1: return tile<1>(a, lda, ks, b, kc, c, ldc, accumulate);
    case 2: return tile<2>(a, lda, ks, b, kc, c, ldc, accumulate);
    case 3: return tile<3>(a, lda, ks, b, kc, c, ldc, accumulate);
    case 4: return tile<4>(a, lda, ks, b, kc, c, ldc, accumulate);
    case 5: return tile<5>(a, lda, ks, b, kc, c, ldc, accumulate);
    default: return tile<6>(a, lda, ks, b, kc, c, ldc, accumulate);
  }
}

template <typename W>
inline void widen_slice(const W* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef KVSERVE_KEYDIFF_LANES8
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, keydiff::load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// c [m, np * 16] = a [m, k] @ the np panels [np, k, 16]. Threads split the panels: each
// streams its share of the weight once per block of `kMC` rows.
template <typename W>
void gemm(const float* a, int64_t m, int64_t k, const W* panels, int64_t np, float* c) {
  const int64_t ldc = np * kNR;
  const bool blocked = m > kWholeK;
  const int64_t kc_step = blocked ? kKC : k;
  // A bf16 slice is widened in registers when each of its weights is used once or twice
  // (streamed: half the bytes); a block's is widened into L1 first: widening per tile made
  // a 1,000-row bf16 step 0.85x oneDNN's speed over the widened weight.
  const bool widen = !std::is_same_v<W, float> && blocked;
  // a thread's share: at least 4 panels (~50 KB of a 768-deep fp32 weight) per wake-up
  at::parallel_for(0, np, 4, [&](int64_t p0, int64_t p1) {
    std::vector<float> ap(blocked ? kMC * kc_step : 0), wide(widen ? kc_step * kNR : 0);
    for (int64_t pc = 0; pc < k; pc += kc_step) {
      const int64_t kc = std::min(kc_step, k - pc);
      for (int64_t ic = 0; ic < m; ic += kMC) {
        const int64_t rows = std::min(kMC, m - ic);
        if (blocked) {  // each thread copies the block (~1% of its FMAs on it)
          for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
            const int64_t mr = std::min(kMR, rows - r0);
            float* t = ap.data() + r0 * kc;
            for (int64_t r = 0; r < mr; ++r) {
              const float* src = a + (ic + r0 + r) * k + pc;
              for (int64_t kk = 0; kk < kc; ++kk) t[kk * mr + r] = src[kk];
            }
          }
        }
        for (int64_t p = p0; p < p1; ++p) {
          const W* b = panels + (p * k + pc) * kNR;
          auto tiles = [&](const auto* slice) {
            for (int64_t r = ic; r < ic + rows; r += kMR) {
              const int64_t mr = std::min(kMR, ic + rows - r);
              float* cp = c + r * ldc + p * kNR;
              if (blocked) {
                some_rows(mr, ap.data() + (r - ic) * kc, 1, mr, slice, kc, cp, ldc, pc > 0);
              } else {
                some_rows(mr, a + r * k + pc, k, 1, slice, kc, cp, ldc, pc > 0);
              }
            }
          };
          if (widen) {  // widened once for the block's tiles, not once per tile
            widen_slice(b, kc * kNR, wide.data());
            tiles(wide.data());
          } else {
            tiles(b);
          }
        }
      }
    }
  });
}

// "avx2" where `tile` has its vector loop in this build, else "scalar".
inline const char* isa() {
#ifdef KVSERVE_KEYDIFF_LANES8
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace panels
