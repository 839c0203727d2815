// A linear layer's GEMM over its weight laid out in panels of 16 output columns, for CPUs
// with AVX2 but without AVX-512, and on AMD CPUs (Zen 4) and Intel CPUs without AMX with
// AVX-512 for fp32 and, with bf16 dot products, bf16: faster than oneDNN when decoding,
// level with it (or nearly: 0.93-0.95x at 1,024-2,048 rows on Zen 4, fp32 0.9x on a Xeon;
// bf16 in pairs 0.92-0.97x at 256-1,024 and 1.06-1.77x at 1-64 on Zen 4, 1.5x on a Xeon
// by FMAs, `gemm`'s ByFma) at prefill.
//
// Why: there (AMD Zen 1-3, Intel client cores) a decode step is bound by the weight bytes
// it streams, oneDNN's fp32 kernels stream them at ~70% of what this loop does for 1-12
// rows, and a bf16 weight had to be widened to fp32 for oneDNN (twice the bytes, kept beside
// the bf16 one: three times the memory). Measured on the 160M model's layers (Zen 3, two
// threads; docs/benchmarks.md at commit 505ae8c): 1.3-2x oneDNN's speed at 1-12 rows
// (bf16 2-3x); at prefill sizes (128-1,024 rows) level with it (0.94-1.08x; 0.83-0.96x
// before commit 656a2bc packed each block of rows once and prefetched what the next
// tile needs).
//
// The layout is the one BLIS-style kernels pack their B operand into: panel p holds columns
// 16p..16p+15 of W^T, row after row of K ([ceil(N/16), K, 16], zero columns past N;
// engine/cpu_linear.py lays it out once at load). A tile of up to 6 rows x 16 columns
// lives in 12 of the 16 ymm registers: each k step loads 16 weights (a bf16 one widened
// in registers: the top half of an fp32) and broadcasts 6 inputs into 12 FMAs; with
// AVX-512, 12 rows in 12 zmm registers, each input broadcast inside its FMA. Steps of up
// to `kWholeK` rows (decoding) run whole K in registers, streaming every weight once. Longer
// steps (prefill) work in blocks: `kMC` rows by `kKC` of K of the input, packed once so that
// a tile's inputs are adjacent (L2), against one panel's slice at a time (L1), as BLIS does.
//
// The products are the ones a GEMM makes, summed in fp32 in k order; a bf16 layer rounds
// once at the end (bias added in fp32 first), as a bf16 GEMM that accumulates in fp32 does.
//
// Where the CPU has bf16 dot products (AVX512-BF16: Zen 4, Cooper Lake and later), a bf16
// layer's panels hold pairs instead: [ceil(N/16), K/2, 16, 2], the two bf16 weights of
// consecutive k side by side for each column, so that one `vdpbf16ps` multiplies a 32-bit
// pair of the (bf16) input, broadcast, into 16 columns' two products at once: twice the
// products of an fp32 FMA an instruction, and no widening (`Pair`; the op takes a bf16
// input as it is). The sum is still fp32, a pair's two products added one after the other.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../native/csrc/key_diversity.h"  // load8 / load16: fp32 or widened bf16 lanes
#include "../../native/csrc/team.h"

namespace panels {

#if defined(KVSERVE_KEYDIFF_AVX512) && defined(__AVX512BF16__)
#define KVSERVE_PANELS_BF16_DOT 1
#endif

// Two bf16 values of consecutive k (the lower one first), as one 32-bit element: of the
// input, and of a pair panel's column. A pair GEMM is the fp32 one over K/2 such elements.
using Pair = uint32_t;

inline float bf16_lo(Pair p) { return __builtin_bit_cast(float, p << 16); }
inline float bf16_hi(Pair p) { return __builtin_bit_cast(float, p & 0xffff0000u); }

constexpr int64_t kNR = 16;   // columns a panel holds: two 8-lane registers, or one 16-lane
#ifdef KVSERVE_KEYDIFF_AVX512
// Rows of a register tile: 12 x 1 accumulators of the 32 zmm registers (the 6-row AVX2
// tile re-reads each panel slice twice as often: 0.84x oneDNN at 256-2,048 rows on Zen 4).
constexpr int64_t kMR = 12;
// The most rows a tile holds (16 accumulators): a step of 13-16 rows is one tile, not
// two of 7-8, whose second re-reads every weight slice (the medians of three passes over
// the 160M model's layers at 13, 15 and 16 rows: bf16 0.88-0.94x the time, fp32
// 0.90-0.94x). Longer steps keep tiles of about kMR rows: tiles of 16 were no faster at
// 20-144 rows, and fp32 at 64 rows 2-4% slower (docs/benchmarks.md at commit 63a62e5).
constexpr int64_t kTallest = 16;
// Rows up to which a step runs whole K unpacked: one tile. Twelve rows of a 3,072-deep
// input read in place are 144 KB, past L1, so longer steps are packed (their weights
// still stream once up to kMC rows): 16-64 rows went from 0.8-0.9x oneDNN to 1.0-1.1x.
constexpr int64_t kWholeK = kMR;
#else
constexpr int64_t kMR = 6;    // rows of a register tile: 6 x 2 accumulators
constexpr int64_t kTallest = kMR;
constexpr int64_t kWholeK = 72;  // rows up to which a step is one block: weights stream once
#endif
// FMAs over pairs (`gemm`'s ByFma, AVX-512): steps of kFmaWholeFrom to kFmaWholeTo rows run
// whole K (`tile_fma_pairs`: the weights widened in registers as they stream), longer ones
// in packed blocks; fewer rows keep the dot products, memory-bound there, where the
// widening's ALU ops would only add work. The blocked path's packing and widening into L1
// made 13-16 rows slower than 12, and 17-24 rows 3-10% slower than whole K in tiles of
// 11-12 rows, each widening the slice again from L1 or L2 (an Intel Xeon, commit a9d648a).
constexpr int64_t kFmaWholeFrom = 6;
constexpr int64_t kFmaWholeTo = 32;
// Steps of up to `whole_k_to` rows (the op's argument, kWholeK at most; native/build.py
// `whole_k_to`) run whole K, unpacked; longer ones in packed blocks. On an Intel Xeon
// fp32 steps of 6-12 rows were 1.05-1.2x as fast packed (commit 8f96091); on Zen 4 packing
// began at 13.
// A whole-K step (up to kWholeK rows) prefetches the next panel's slice from
// `prefetch_from` rows on (the op's argument, native/build.py `prefetch_from`: one place
// decides a CPU vendor's kernel choices): on AMD Zen 4 each k step of 1-5 rows was too
// short to hide it (level or 5-10% slower: docs/benchmarks.md at commit 3ef4ea8); an Intel
// Xeon (no AMX) streamed the weights of 1-4 rows 1.2-1.4x as fast with it (commit 24816c8).
// K of a longer step's block: 24 KB of an fp32 panel (L1); in pairs (2 x 384 of K) the
// same bytes (192 pairs made 64-1,024-row bf16 steps ~5% slower, 768 no faster)
constexpr int64_t kKC = 384;
constexpr int64_t kMC = 144;     // rows of a longer step's block: 216 KB of fp32 input (L2)
// Deepest input whose whole block (kMC rows, fp32: 442 KB at 768) a step keeps in L2
// (`gemm`'s panels_outer)
constexpr int64_t kPanelsOuterK = 2 * kKC;

#if defined(KVSERVE_KEYDIFF_AVX512)
// Both AVX-512 tiles' rows (fp32 below, pairs after it): accumulator c<r> is row r of C.
#define KVSERVE_PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
  X(12) X(13) X(14) X(15)
#define KVSERVE_PANEL_INIT(r) \
  if constexpr (r < MR) c##r = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
#define KVSERVE_PANEL_STORE(r) \
  if constexpr (r < MR) _mm512_storeu_ps(c + r * ldc, c##r);
#endif

// c[r, 0:16] (+)= sum_k a[r * lda + k] * b[k * 16 + 0:16] for the MR rows of a tile, or
// with PACKED, a[k * MR + r] (the packed input: the tile's rows adjacent, a constant
// stride: the runtime one cost ~4% at 1,024 rows).
// With PF, each k step also prefetches row k of `next` (the next panel's slice, as stored):
// that slice is then on chip when its own first tile starts, not requested a line at a time
// by the loads that need it (a decode step streams its weight from DRAM at ~1.15x the rate
// with it, and a prefill step no longer stalls on L3 at each panel). Into L2, not L1: a
// line prefetched into L1 holds one of L1's few miss buffers until DRAM answers, so the
// stream stalled the tile's own loads; L2 keeps many more in flight (Zen 4, the 160M
// model's layers, two threads: bf16 at 8-16 rows 0.67-0.76x the time of a pass, 24-32
// rows 0.84-0.87x; fp32 12-32 rows 0.72-0.87x; the AVX2 tile's fp32 8-32 rows
// 0.78-0.87x; prefill sizes level: docs/benchmarks.md at commit 3ef4ea8).
template <int MR, bool PACKED, bool PF, typename W, typename N>
inline void tile(const float* a, int64_t lda, const W* b, int64_t kc, float* c, int64_t ldc,
                 bool accumulate, const N* next) {
#if defined(KVSERVE_KEYDIFF_AVX512)
  // One 16-lane accumulator a row: each k step loads the panel's 16 weights once (a bf16
  // one widened: the top half of an fp32) and multiplies each row's input, broadcast
  // from memory inside the FMA, into its row. Zen 4 runs a 512-bit FMA as two 256-bit
  // halves, so the gain over the AVX2 tile is twice the rows per weight load, not lanes.
  [[maybe_unused]] __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15;
#define KVSERVE_PANEL_FMA(r)                                                               \
  if constexpr (r < MR)                                                                    \
    c##r = _mm512_fmadd_ps(_mm512_set1_ps(PACKED ? a[k * MR + r] : a[r * lda + k]), b0, c##r);
  KVSERVE_PANEL_ROWS(KVSERVE_PANEL_INIT)
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(next + k * kNR), _MM_HINT_T1);
    const __m512 b0 = keydiff::load16(b + k * kNR);
    KVSERVE_PANEL_ROWS(KVSERVE_PANEL_FMA)
  }
  KVSERVE_PANEL_ROWS(KVSERVE_PANEL_STORE)
#elif defined(KVSERVE_KEYDIFF_LANES8)
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
    const __m256 ar = _mm256_broadcast_ss(PACKED ? a + k * MR + r : a + r * lda + k);  \
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
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(next + k * kNR), _MM_HINT_T1);
    const __m256 b0 = load8(b + k * kNR), b1 = load8(b + k * kNR + 8);
    KVSERVE_PANEL_ROWS(KVSERVE_PANEL_FMA)
  }
  KVSERVE_PANEL_ROWS(KVSERVE_PANEL_STORE)
#else
  (void)next;
  float acc[MR][kNR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNR; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : 0.0f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < kNR; ++j)
        acc[r][j] += (PACKED ? a[k * MR + r] : a[r * lda + k]) * static_cast<float>(b[k * kNR + j]);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNR; ++j) c[r * ldc + j] = acc[r][j];
#endif
}
#undef KVSERVE_PANEL_FMA  // ROWS, INIT and STORE last through the pair tile

// The same tile over pairs: c[r, 0:16] (+)= sum over the kc pairs k of a's pair times the
// panel's pair of each column (b[k * 16 + j]), the higher k's product added first, as
// `vdpbf16ps` does (round to nearest even, denormals flushed).
template <int MR, bool PACKED, bool PF>
inline void tile(const Pair* a, int64_t lda, const Pair* b, int64_t kc, float* c, int64_t ldc,
                 bool accumulate, const Pair* next) {
#if defined(KVSERVE_PANELS_BF16_DOT)
  // The input's pair broadcast inside the instruction (`m32{1to16}`), written in asm: GCC 12
  // emits a vpbroadcastd of its own for `_mm512_dpbf16_ps(c, set1(pair), w)` (64-1,024-row
  // steps of the 160M model's layers were 7-10% slower that way).
  [[maybe_unused]] __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15;
#define KVSERVE_PANEL_DOT(r)                                                                  \
  if constexpr (r < MR)                                                                       \
    asm("vdpbf16ps %1%{1to16%}, %2, %0"                                                       \
        : "+v"(c##r) : "m"(PACKED ? a[k * MR + r] : a[r * lda + k]), "v"(b0));
  KVSERVE_PANEL_ROWS(KVSERVE_PANEL_INIT)
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(next + k * kNR), _MM_HINT_T1);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + k * kNR);
    KVSERVE_PANEL_ROWS(KVSERVE_PANEL_DOT)
  }
  KVSERVE_PANEL_ROWS(KVSERVE_PANEL_STORE)
#undef KVSERVE_PANEL_DOT
#else
  // Anywhere else (a test of the layout on a CPU without the instruction): the same sums.
  (void)next;
  float acc[MR][kNR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNR; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : 0.0f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MR; ++r) {
      const Pair x = PACKED ? a[k * MR + r] : a[r * lda + k];
      for (int j = 0; j < kNR; ++j) {
        const Pair w = b[k * kNR + j];
        acc[r][j] += bf16_hi(x) * bf16_hi(w);
        acc[r][j] += bf16_lo(x) * bf16_lo(w);
      }
    }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNR; ++j) c[r * ldc + j] = acc[r][j];
#endif
}
#undef KVSERVE_PANEL_ROWS
#undef KVSERVE_PANEL_INIT
#undef KVSERVE_PANEL_STORE

#ifdef KVSERVE_KEYDIFF_AVX512
// The most rows of a wide tile: 2 x 12 accumulators, two weight registers and a broadcast
// input of the 32 zmm registers.
constexpr int64_t kWideRows = 12;
#define KVSERVE_WIDE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// Two panels' tile of a packed block (fp32 slices: fp32 panels, or bf16 ones widened into
// L1): c[r, 0:32] (+)= sum_k a[k * MR + r] * (b[k * 16 + 0:16], b2[k * 16 + 0:16]), the
// second panel's columns 16 after the first's in C. Why: the one-panel tile loads each
// input once per 16 columns, 13 loads for 12 FMAs, and Intel's cores (two 512-bit FMAs
// but two 512-bit loads a cycle) ran it at ~85% of their FMA rate; with each broadcast
// input feeding two panels it is 14 loads for 24 FMAs (docs/benchmarks.md at commit 16102ed).
// The same products summed in the same k order as `tile`: the same bits.
template <int MR, bool PF, typename N>
inline void tile2(const float* a, const float* b, const float* b2, int64_t kc, float* c,
                  int64_t ldc, bool accumulate, const N* next, const N* next2) {
  [[maybe_unused]] __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;
  [[maybe_unused]] __m512 d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11;
#define KVSERVE_WIDE_INIT(r)                                                           \
  if constexpr (r < MR) {                                                              \
    c##r = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();            \
    d##r = accumulate ? _mm512_loadu_ps(c + r * ldc + kNR) : _mm512_setzero_ps();      \
  }
#define KVSERVE_WIDE_FMA(r)                                                            \
  if constexpr (r < MR) {                                                              \
    const __m512 x = _mm512_set1_ps(a[k * MR + r]);                                    \
    c##r = _mm512_fmadd_ps(x, b0, c##r);                                               \
    d##r = _mm512_fmadd_ps(x, b1, d##r);                                               \
  }
#define KVSERVE_WIDE_STORE(r)                                                          \
  if constexpr (r < MR) {                                                              \
    _mm512_storeu_ps(c + r * ldc, c##r);                                               \
    _mm512_storeu_ps(c + r * ldc + kNR, d##r);                                         \
  }
  KVSERVE_WIDE_ROWS(KVSERVE_WIDE_INIT)
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kNR), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next2 + k * kNR), _MM_HINT_T1);
    }
    const __m512 b0 = _mm512_loadu_ps(b + k * kNR), b1 = _mm512_loadu_ps(b2 + k * kNR);
    KVSERVE_WIDE_ROWS(KVSERVE_WIDE_FMA)
  }
  KVSERVE_WIDE_ROWS(KVSERVE_WIDE_STORE)
#undef KVSERVE_WIDE_INIT
#undef KVSERVE_WIDE_FMA
#undef KVSERVE_WIDE_STORE
}
#undef KVSERVE_WIDE_ROWS

template <bool PF, typename N>
inline void wide_rows(int64_t mr, const float* a, const float* b, const float* b2, int64_t kc,
                      float* c, int64_t ldc, bool accumulate, const N* next, const N* next2) {
  switch (mr) {
#define KVSERVE_WIDE_CASE(r) \
    case r: return tile2<r, PF>(a, b, b2, kc, c, ldc, accumulate, next, next2);
    KVSERVE_WIDE_CASE(1) KVSERVE_WIDE_CASE(2) KVSERVE_WIDE_CASE(3) KVSERVE_WIDE_CASE(4)
    KVSERVE_WIDE_CASE(5) KVSERVE_WIDE_CASE(6) KVSERVE_WIDE_CASE(7) KVSERVE_WIDE_CASE(8)
    KVSERVE_WIDE_CASE(9) KVSERVE_WIDE_CASE(10) KVSERVE_WIDE_CASE(11)
#undef KVSERVE_WIDE_CASE
    default: return tile2<kWideRows, PF>(a, b, b2, kc, c, ldc, accumulate, next, next2);
  }
}
#else
constexpr int64_t kWideRows = 0;  // no wide tile: 16 registers hold one panel's
#endif

template <bool PACKED, bool PF, typename A, typename W, typename N>
inline void some_rows(int64_t mr, const A* a, int64_t lda, const W* b, int64_t kc, float* c,
                      int64_t ldc, bool accumulate, const N* next) {
  switch (mr) {
    case 1: return tile<1, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 2: return tile<2, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 3: return tile<3, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 4: return tile<4, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 5: return tile<5, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
#ifdef KVSERVE_KEYDIFF_AVX512
    case 6: return tile<6, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 7: return tile<7, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 8: return tile<8, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 9: return tile<9, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 10: return tile<10, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 11: return tile<11, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 12: return tile<12, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 13: return tile<13, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 14: return tile<14, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
    case 15: return tile<15, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
#endif
    default: return tile<kTallest, PACKED, PF>(a, lda, b, kc, c, ldc, accumulate, next);
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

// kc / 2 rows of a pair panel's slice ([kc / 2, 16] pairs) widened into fp32 [kc, 16], each
// pair's higher k first: the order `vdpbf16ps` adds a pair's two products in, so that FMAs
// over this slice (and an input packed the same way, `pack_rows`) make the pair tile's sums
// bit for bit (`gemm`'s ByFma).
inline void widen_pair_slice(const Pair* src, int64_t kc, float* dst) {
  for (int64_t kp = 0; kp < kc / 2; ++kp) {
    const Pair* s = src + kp * kNR;
    float* d = dst + 2 * kp * kNR;
#ifdef KVSERVE_KEYDIFF_AVX512
    const __m512i x = _mm512_loadu_si512(s);
    _mm512_storeu_ps(d, _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536))));
    _mm512_storeu_ps(d + kNR, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
#else
    for (int64_t j = 0; j < kNR; ++j) {
      d[j] = bf16_hi(s[j]);
      d[kNR + j] = bf16_lo(s[j]);
    }
#endif
  }
}

#ifdef KVSERVE_KEYDIFF_AVX512
// A whole-K step's tile of FMAs over a pair panel (`gemm`'s ByFma, kFmaWholeFrom-To rows):
// c[r, 0:16] = sum over the kc / 2 pairs of the input's pair times each column's, each
// pair's higher k first (the pair tile's bits), the weights widened in registers as they
// stream (two ALU ops a 16 pairs, shared by the tile's rows) and the input from `aw`, its
// rows widened once a call (lda floats apart, `widen_pair_slice`'s layout: per 16 pairs
// their 16 higher then 16 lower values). Why: `vdpbf16ps` runs at half the FMAs' rate on
// Intel's cores, and at 6-12 rows a decode step's dot products were bound by it.
template <int MR, bool PF>
inline void tile_fma_pairs(const float* aw, int64_t lda, const Pair* b, int64_t kc, float* c,
                           int64_t ldc, const Pair* next) {
  [[maybe_unused]] __m512 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15;
#define KVSERVE_FP_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
  X(12) X(13) X(14) X(15)
#define KVSERVE_FP_INIT(r) if constexpr (r < MR) c##r = _mm512_setzero_ps();
#define KVSERVE_FP_HI(r) if constexpr (r < MR) c##r = _mm512_fmadd_ps(_mm512_set1_ps(ag[r * lda + j]), hi, c##r);
#define KVSERVE_FP_LO(r) \
  if constexpr (r < MR) c##r = _mm512_fmadd_ps(_mm512_set1_ps(ag[r * lda + kNR + j]), lo, c##r);
#define KVSERVE_FP_STORE(r) if constexpr (r < MR) _mm512_storeu_ps(c + r * ldc, c##r);
  KVSERVE_FP_ROWS(KVSERVE_FP_INIT)
  for (int64_t g = 0; g < kc / (2 * kNR); ++g) {  // 16 pairs of the input at a time
    const float* ag = aw + g * 2 * kNR;
    for (int64_t j = 0; j < kNR; ++j) {
      const int64_t kp = g * kNR + j;
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(next + kp * kNR), _MM_HINT_T1);
      const __m512i x = _mm512_loadu_si512(b + kp * kNR);
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536)));
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      KVSERVE_FP_ROWS(KVSERVE_FP_HI)
      KVSERVE_FP_ROWS(KVSERVE_FP_LO)
    }
  }
  KVSERVE_FP_ROWS(KVSERVE_FP_STORE)
#undef KVSERVE_FP_INIT
#undef KVSERVE_FP_HI
#undef KVSERVE_FP_LO
#undef KVSERVE_FP_STORE
}

template <bool PF>
inline void fma_pair_rows(int64_t mr, const float* aw, int64_t lda, const Pair* b, int64_t kc,
                          float* c, int64_t ldc, const Pair* next) {
  switch (mr) {
#define KVSERVE_FP_CASE(r) case r + 1: return tile_fma_pairs<r + 1, PF>(aw, lda, b, kc, c, ldc, next);
    KVSERVE_FP_ROWS(KVSERVE_FP_CASE)
#undef KVSERVE_FP_CASE
    default: TORCH_CHECK(false, "a whole-K tile of FMAs over pairs holds 1 to 16 rows");
  }
}
#undef KVSERVE_FP_ROWS
#endif

// Rows of each register tile over `rows` rows: one tile up to `kTallest` rows, else as
// many tiles as `kMR`-row ones would take, the rows shared evenly among them. Why: a
// remainder tile of a row or two runs that many chains of dependent dot products, bound
// by their latency rather than the weights' bytes: a pass over the 160M model's bf16
// layers took 17.0 ms at 13 rows as 12 + 1 against 13.0 at 12 (commit 333c2e1, before 13-16
// rows became one tile). Every row is summed in k order in any tile: the same bits.
inline int64_t tile_height(int64_t rows) {
  const int64_t tiles = (rows + kMR - 1) / kMR;
  return rows > kTallest ? (rows + tiles - 1) / tiles : kTallest;
}

// Tiles [t0, t1) of a block of a longer step's input rows, packed: for each block of `kKC`
// of K (at offset pc * rows), each tile of `tile_height(rows)` rows (at r0 * kc) holds its
// rows' values side by side, k after k, so that a tile reads one stream. A bf16 input
// (`uint16_t`: a pair input multiplied by FMAs) is widened as it is packed, each pair's
// higher k first (`widen_pair_slice`).
template <typename A, typename P>
inline void pack_rows(const A* a, int64_t rows, int64_t k, int64_t t0, int64_t t1, P* packed) {
  constexpr bool kPairs = std::is_same_v<A, uint16_t>;  // k, kKC and pc are even then
  static_assert(std::is_same_v<A, P> || (kPairs && std::is_same_v<P, float>));
  const int64_t h = tile_height(rows);
  for (int64_t pc = 0; pc < k; pc += kKC) {
    const int64_t kc = std::min(kKC, k - pc);
    for (int64_t r0 = t0 * h; r0 < std::min(rows, t1 * h); r0 += h) {
      const int64_t mr = std::min(h, rows - r0);
      P* t = packed + pc * rows + r0 * kc;
      for (int64_t kk = 0; kk < kc; ++kk)
        for (int64_t r = 0; r < mr; ++r) {
          if constexpr (kPairs) {
            t[kk * mr + r] = bf16_lo(a[(r0 + r) * k + pc + (kk ^ 1)]);
          } else {
            t[kk * mr + r] = a[(r0 + r) * k + pc + kk];
          }
        }
    }
  }
}

// [tid * share, ...) of n items, at least `grain` to a thread (at::parallel_for's split).
inline std::pair<int64_t, int64_t> share_of(int64_t n, int64_t grain, int tid, int team) {
  const int64_t share = std::max(grain, (n + team - 1) / team);
  const int64_t lo = std::min(n, tid * share);
  return {lo, std::min(n, lo + share)};
}

// No finishing (`NoFinish`): the sums are the output, c [m, np * 16]. With a `finish`
// callable, c is unused: each tile's sums, once its last K block is in, go to
// finish(share, row, rows, panel, count, sums, ld) while they are in L1 (`count`
// panels from `panel` on, side by side: 2 for a wide tile's pair), from scratch `gemm`
// keeps, and the caller adds its bias and rounds into its own output (or keeps only a
// running maximum: an argmax). `share`: the thread's share of the panels, a contiguous
// run, shares in order (share_of), so a row's panels reach a share's finish in increasing
// order (what an argmax over them relies on: layer_ops_cpu.cpp's `linear_panels_argmax`).
// Why: a bf16 layer's whole fp32 C, written and read back by a second pass, was a 50 MB
// detour at 2,048 x 6,144 (the gate/up GEMM ran at ~295 GFLOP/s against ~415 for the other
// layers of that step; with the finishing ~410: docs/benchmarks.md at commit ada9d3b). Where a
// panel's K blocks run one after another (whole K, one K block, or the panels outer), a
// pair of panels is finished before the next pair starts, so a share's scratch is its
// block's rows of two panels ([rows, 32], in L1); a scratch as wide as C, as every finishing
// step had until commit 82d3f6a, wrote a decode step's head (64 x 4,096 fp32) to memory for
// nothing, and the argmax over it cost what writing the logits and reading them back did.
struct NoFinish {};

// c = a [m, k] @ the np panels [np, k, 16]. Blocks of `kMC` rows one after
// the other (a step of up to `kWholeK` rows is one block, not packed): the threads pack a
// block's rows together, then multiply it splitting the panels, so that the block's input
// and outputs stay on chip across its K blocks. Why one team with barriers: every thread
// copying every block cost 6-10% of a 768-deep layer (with spinning threads, whose
// barriers are cheap; sleeping ones copy instead: `own`); a whole 2,048-row input packed
// first spilled to DRAM at 3,072 deep (0.77x oneDNN); and a parallel region per block woke
// the threads twice per 144 rows, which with passive waits (`kvserve serve`'s) made the
// demo model's 2,048-row layers 0.8x as fast. Over pairs (A and W `Pair`), k counts pairs.
//
// ByFma (pairs, a step of at least `kFmaWholeFrom` rows): the pairs multiplied by fp32
// FMAs, not `vdpbf16ps`, for CPUs that run the FMAs at twice its rate (an Intel Xeon with
// AVX-512 and bf16 dot products but no AMX: a pass over the 160M model's bf16 layers at
// 256-2,048 rows took 0.68-0.69x the time, commit 16102ed; at 8-16 rows 0.8-0.87x, commit
// a9d648a): up to kFmaWholeTo rows the weights widened in registers and the input once a call,
// beyond it the input widened as it is packed and each panel's slice into L1; always
// each pair's higher k first, so the sums are the pair tile's bit for bit (vdpbf16ps
// flushes denormals, the FMAs keep them). The same panels still serve shorter steps by
// dot products: one layout, no second copy.
template <typename A, typename W, typename F = NoFinish, bool ByFma = false>
void gemm(const A* a, int64_t m, int64_t k, const W* panels, int64_t np, float* c,
          int64_t prefetch_from, int64_t whole_k_to = 0, F finish = {}) {
  constexpr bool kFinishes = !std::is_same_v<F, NoFinish>;
  static_assert(std::is_same_v<A, float> || std::is_same_v<W, Pair>, "a pair input needs pair panels");
  static_assert(!ByFma || std::is_same_v<A, Pair>, "FMAs over pairs take a pair input");
  // ByFma: from here on k counts bf16 values (two a pair), the input read as such (In) and
  // packed widened (P); a panel's slice starts (p * k + pc) * 16 values in
  using In = std::conditional_t<ByFma, uint16_t, A>;
  using P = std::conditional_t<ByFma, float, A>;
  constexpr int64_t kPerW = ByFma ? 2 : 1;  // the input's values a W element holds
  const In* in = reinterpret_cast<const In*>(a);
  if constexpr (ByFma) {
    k *= 2;
    TORCH_CHECK(m > kFmaWholeTo || k % (2 * kNR) == 0,
                "FMAs over pairs of a whole-K step take K in whole groups of 32");
  }
  const int64_t ldc = np * kNR;  // the output's row stride
  // up to `whole_k_to` rows (0: kWholeK, and at most it) whole K, unpacked; FMAs over
  // pairs their own
  const int64_t whole = whole_k_to > 0 ? std::min(whole_k_to, kWholeK) : kWholeK;
#ifdef KVSERVE_KEYDIFF_AVX512
  const bool blocked = m > (ByFma ? kFmaWholeTo : whole);
#else
  const bool blocked = m > whole;
#endif
  const int64_t kc_step = blocked ? kKC : k, mc = blocked ? kMC : std::max<int64_t>(m, 1);
  // A bf16 slice is widened in registers when each of its weights is used once or twice
  // (streamed: half the bytes); a block's is widened into L1 first: widening per tile made
  // a 1,000-row bf16 step 0.85x oneDNN's speed over the widened weight.
  constexpr bool kWidens = (std::is_same_v<A, float> && !std::is_same_v<W, float>) || ByFma;
  const bool widen = kWidens && blocked;
  // Each thread packs every block whole for itself when the step is one block, or when
  // the team sleeps (`kvserve serve`): there a barrier between packing and multiplying is
  // a futex wake-up, two per 144 rows, and copying a block twice costs less (1,000-token
  // prefills of the 160M model in a server: 1.58-1.70 s against 1.75-1.78 with barriers).
  const bool own = blocked && (m <= kMC || team::sleeps());
  // A block's K blocks inside each panel, not its panels inside each K block, where the
  // block's whole packed input stays in L2 (up to kPanelsOuterK deep): each tile's sums
  // then stay in L1 between its K blocks, where they went out to L3 and back once a K
  // block when the block's outputs were wide (the gate/up GEMM, 768 x 6,144: 144 rows x
  // 6,144 of fp32 sums, 3.5 MB; the other order, as deep inputs need, keeps a K block's
  // slice of the input in L2 and the block's sums there across its K blocks).
  const bool panels_outer = blocked && k > kKC && k <= kPanelsOuterK;
  // at least 4 panels (~50 KB of a 768-deep fp32 weight) a thread, as at::parallel_for's
  // grain sized the team: a thread with no panels would only pack and wait at barriers
  const int64_t grain = 4;
  // and one thread for a small product where waking a sleeping team costs more (team.h)
  const int64_t depth = std::is_same_v<A, Pair> && !ByFma ? 2 * k : k;  // K, in the input's values
  const bool small = team::sleeps() &&
      np * kNR * depth * std::max<int64_t>(m, 4) < team::kSleepingLinearWork;
  const int64_t wanted = small ? 1 : at::get_num_threads();
  const int threads = static_cast<int>(std::min(wanted, (np + grain - 1) / grain));
  // each share's L1 copy of a widened bf16 slice, allocated here: nothing inside the job
  // may throw (a share that threw would leave the others waiting at a barrier)
  std::vector<float> wide_all(widen ? std::max(threads, 1) * 2 * kc_step * kNR : 0);
  // a block's packed rows: one copy, or one a thread (`own`); not value-initialised:
  // pack_rows writes every element a block reads
  const int64_t packed_size = std::min(m, mc) * k;
  std::unique_ptr<P[]> packed(
      blocked ? new P[(own ? std::max(threads, 1) : 1) * packed_size] : nullptr);
  // ByFma, whole K: the input's rows widened once, here, for every thread's tiles (not
  // value-initialised: every element is written)
  std::unique_ptr<float[]> aw(ByFma && !blocked ? new float[m * k] : nullptr);
  if constexpr (ByFma) {
    for (int64_t r = 0; r < m && !blocked; ++r)
      widen_pair_slice(reinterpret_cast<const Pair*>(a) + r * (k / 2), k / kNR, aw.get() + r * k);
  }
  // A finishing step's scratch (see above): a share's [rows, 2 x 16] where a pair of
  // panels finishes before the next starts, else a block's rows of every panel, shared
  const int64_t block = std::min(m, mc);
  const bool by_pair = kFinishes && (!blocked || kc_step >= k || panels_outer);
  const int64_t cld = kFinishes && by_pair ? 2 * kNR : ldc;  // a tile's row stride
  std::unique_ptr<float[]> scratch(
      kFinishes ? new float[by_pair ? std::max(threads, 1) * block * cld : block * ldc] : nullptr);
  auto body = [&](int tid, int team) {
    const auto [p0, p1] = share_of(np, grain, tid, team);
    float* wide = wide_all.data() + (widen ? tid * 2 * kc_step * kNR : 0);
    P* const mine = packed.get() + (own ? tid * packed_size : 0);
    float* const sums = kFinishes ? scratch.get() + (by_pair ? tid * block * cld : 0) : c;
    for (int64_t ic = 0; ic < m; ic += mc) {
      const int64_t rows = std::min(mc, m - ic), h = tile_height(rows);
      if (own) {
        pack_rows(in + ic * k, rows, k, 0, (rows + h - 1) / h, mine);
      } else if (blocked) {  // all threads take this branch or none: the barriers match
        const auto [t0, t1] = share_of((rows + h - 1) / h, 1, tid, team);
        pack_rows(in + ic * k, rows, k, t0, t1, mine);
        team::get().barrier(team);
      }
      // Two panels side by side in the wide tile where the packed input is fp32 and the
      // tiles are short enough (AVX-512), else one.
      const int64_t width = std::is_same_v<P, float> && blocked && h <= kWideRows ? 2 : 1;
      // `n` (1 or 2) panels' slices of kc of K from pc on, against the block's rows.
      auto slice_of = [&](int64_t p, int64_t n, int64_t pc) {
        const int64_t kc = std::min(kc_step, k - pc);
        const int64_t stride = k * kNR / kPerW;  // a panel, in W's elements
        const W* b = panels + p * stride + pc * kNR / kPerW;
        // The slices after these in the order below (these on the last: prefetching them
        // again is harmless): the next panels' at pc, or with the panels outer these
        // panels' next K block (the next panel's first after the last one: a panel is
        // [k, 16], one after the other).
        const W* next = panels_outer ? (p + n < p1 || pc + kc < k ? b + kc * kNR / kPerW : b)
                                     : (p + n < p1 ? b + n * stride : b);
        const W* next2 = n == 2 ? next + stride : next;
        // as the first tile's k steps prefetch them: ByFma's k steps are half a pair each
        auto by_k = [](const W* w) {
          if constexpr (ByFma) return reinterpret_cast<const uint16_t*>(w);
          else return w;
        };
        const auto* next_k = by_k(next);
        const auto* next2_k = by_k(next2);
        auto tiles = [&](const auto* slice, const auto* slice2) {
          for (int64_t r = 0; r < rows; r += h) {
            const int64_t mr = std::min(h, rows - r);
            float* cp = kFinishes ? sums + r * cld + (by_pair ? 0 : p * kNR) : c + (ic + r) * ldc + p * kNR;
            const bool first = r == 0;  // the first tile pulls the next panels' slices in
            using S = std::remove_cv_t<std::remove_pointer_t<decltype(slice)>>;
            if constexpr (ByFma) {
#ifdef KVSERVE_KEYDIFF_AVX512
              if constexpr (std::is_same_v<S, Pair>) {  // whole K: the pairs as they stream
                const float* ar = aw.get() + (ic + r) * k;
                if (first && m >= prefetch_from) {
                  fma_pair_rows<true>(mr, ar, k, slice, kc, cp, cld, next);
                } else {
                  fma_pair_rows<false>(mr, ar, k, slice, kc, cp, cld, next);
                }
              }
#endif
            } else if (!blocked) {
              const A* ar = a + (ic + r) * k + pc;
              if (first && m >= prefetch_from) {
                some_rows<false, true>(mr, ar, k, slice, kc, cp, cld, pc > 0, next_k);
              } else {
                some_rows<false, false>(mr, ar, k, slice, kc, cp, cld, pc > 0, next_k);
              }
            }
            if constexpr (ByFma && std::is_same_v<S, Pair>) {
              // whole K: done above
            } else if (blocked) {
              // The next tile's rows of C, asked for now: they are a whole row of C apart,
              // and their misses stalled every tile's start (~10% of a 1,024-row step).
              for (int64_t rr = r + mr; rr < std::min(r + mr + h, rows); ++rr) {
                __builtin_prefetch(cp + (rr - r) * cld, 1);
                __builtin_prefetch(cp + (rr - r) * cld + n * kNR - 1, 1);
              }
              const P* ap = mine + pc * rows + r * kc;
#ifdef KVSERVE_KEYDIFF_AVX512
              if constexpr (std::is_same_v<P, float> && std::is_same_v<S, float>) {
                if (n == 2) {
                  if (first) {
                    wide_rows<true>(mr, ap, slice, slice2, kc, cp, cld, pc > 0, next_k, next2_k);
                  } else {
                    wide_rows<false>(mr, ap, slice, slice2, kc, cp, cld, pc > 0, next_k, next2_k);
                  }
                  if constexpr (kFinishes) {
                    if (pc + kc == k) {
                      finish(tid, ic + r, mr, p, 2, static_cast<const float*>(cp), cld);
                    }
                  }
                  continue;
                }
              }
#endif
              if (first) {
                some_rows<true, true>(mr, ap, 0, slice, kc, cp, cld, pc > 0, next_k);
              } else {
                some_rows<true, false>(mr, ap, 0, slice, kc, cp, cld, pc > 0, next_k);
              }
            }
            if constexpr (kFinishes) {
              if (pc + kc == k) finish(tid, ic + r, mr, p, 1, static_cast<const float*>(cp), cld);
            }
          }
        };
        if constexpr (ByFma) {
          if (!blocked) {  // whole K: widened in registers
            tiles(b, b);
            return;
          }
          widen_pair_slice(b, kc, wide);
          if (n == 2) widen_pair_slice(b + stride, kc, wide + kc * kNR);
          tiles(static_cast<const float*>(wide), static_cast<const float*>(wide + kc * kNR));
        } else {
          if constexpr (kWidens) {
            if (widen) {  // widened once for the block's tiles, not once per tile
              widen_slice(b, kc * kNR, wide);
              if (n == 2) widen_slice(b + stride, kc * kNR, wide + kc * kNR);
              tiles(static_cast<const float*>(wide), static_cast<const float*>(wide + kc * kNR));
              return;
            }
          }
          tiles(b, b + (n == 2 ? stride : 0));
        }
      };
      // the last panel of an odd share alone
      auto panels_from = [&](int64_t p) { return std::min(width, p1 - p); };
      if (panels_outer) {
        for (int64_t p = p0; p < p1; p += width)
          for (int64_t pc = 0; pc < k; pc += kc_step) slice_of(p, panels_from(p), pc);
      } else {
        for (int64_t pc = 0; pc < k; pc += kc_step)
          for (int64_t p = p0; p < p1; p += width) slice_of(p, panels_from(p), pc);
      }
      if (blocked && !own) team::get().barrier(team);  // the next block's packing overwrites this one's
    }
  };
  team::get().run(threads, body, /*together=*/blocked && !own);  // its shares meet at barriers
}

// "avx2" / "avx512" where `tile` has its vector loop in this build ("avx512_bf16": and the
// pair tile its dot products), else "scalar".
inline const char* isa() {
#if defined(KVSERVE_PANELS_BF16_DOT)
  return "avx512_bf16";
#elif defined(KVSERVE_KEYDIFF_AVX512)
  return "avx512";
#elif defined(KVSERVE_KEYDIFF_LANES8)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace panels
