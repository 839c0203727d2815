// The element-wise parts of a Llama layer, fused: RMSNorm (with the residual add),
// SiLU-and-mul and RoPE, each one pass over memory; and linear layers over their weights in
// 16-column panels, for CPUs with AVX2 but no AVX-512 (`linear_panels`, linear_panels.h),
// many MoE experts' at once (`linear_panels_grouped`).
//
// Registered as torch.ops.kvserve_layer.*; engine/layer_ops.py builds it on first use
// and keeps torch's ops as the reference path. Why: in eager torch these are 3-8 ops
// each (RMSNorm: to-float, pow, mean, add, rsqrt, mul, cast, mul), every one a pass
// over the activations and, under passive OpenMP waiting, a wake-up of the other
// threads. They were ~17% of a prefill step on the 160M model and ~8% of a decode
// step at 32 rows (the GEMMs are the rest). vLLM's CPU backend gets the same fusion
// from torch.compile's inductor.
//
// Every rounding transformers makes in 16-bit dtypes is made here at the same point
// (the sum before the norm, the normed value before the weight, cos/sin, each product
// of RoPE), so bf16/fp16 results equal transformers' but for the order of the norm's
// sum and exp's last ulp. Built with -ffp-contract=off: an FMA would round differently
// from torch's separate mul and add, and fp32 RoPE is then bit-exact.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "linear_panels.h"

namespace {

// Rows a thread must have before a second one is woken: below ~32k elements a
// wake-up costs more than the pass (a decode step's rows run on the calling thread).
// Where the team sleeps (`kvserve serve`) a wake-up is a futex call and a reschedule,
// which pays from ~512k elements: measured (Zen 4, passive, µs a call) add_rms_norm over
// 100 x 768 17 on one thread against 65 on two, 400 rows 83 against 90, 800 rows 155
// against 119; silu_and_mul over 64 x 6,144 105 against 159, 100 rows 171 against 145.
int64_t grain(int64_t row_elems) {
  const int64_t work = team::sleeps() ? int64_t{1} << 19 : int64_t{1} << 15;
  return std::max<int64_t>(1, work / std::max<int64_t>(1, row_elems));
}

// bf16 <-> fp32 by their bits, branch-free so that the row loops vectorize (c10's
// conversion tests for NaN with a branch: 20x slower over a [32, 6144] silu_and_mul).
// The same rounding as c10::BFloat16: to nearest even, any NaN to the quiet 0x7FC0.
template <typename T>
inline float f32(T v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(v);
  }
}

template <typename T>
inline T to(float v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return at::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), at::BFloat16::from_bits());
  } else {
    return static_cast<T>(v);
  }
}

#ifdef KVSERVE_KEYDIFF_AVX512
// `to<at::BFloat16>` of 16 floats at once: the same bits.
inline __m256i to_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// Round a float to T and back: where transformers' 16-bit ops round (identity in fp32).
template <typename T>
inline float r(float v) { return f32(to<T>(v)); }

// exp(x) for x <= 0, branch-free so the compiler vectorizes the loops that call it:
// x = n ln2 + f with |f| <= ln2/2, exp(f) by a degree-6 polynomial (< 2 ulp), 2^n by
// the exponent bits. Clamped at -87 so 2^n stays normal.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  const float f = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x * sigmoid(x) from exp(-|x|) only, so exp never overflows. -inf gives NaN, as
// torch's x / (1 + exp(-x)) does.
inline float silu(float x) {
  const float e = exp_nonpos(-std::fabs(x));
  const float s = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return x == -INFINITY ? NAN : x * s;
}

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += f32(x[i]) * f32(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) out[i] = to<T>(f32(w[i]) * r<T>(f32(x[i]) * inv));
}

// Pragmas cannot sit inside AT_DISPATCH's macro argument: the row loops live here.
template <typename T>
void add_norm_row(T* x, T* res, const T* w, int64_t h, float eps) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) res[i] = to<T>(f32(res[i]) + f32(x[i]));
  norm_row(res, w, x, h, eps);
}

template <typename T>
void silu_mul_row(const T* g, T* o, int64_t m) {
  const T* u = g + m;
#pragma omp simd
  for (int64_t i = 0; i < m; ++i) o[i] = to<T>(r<T>(silu(f32(g[i]))) * f32(u[i]));
}

void check_rows(const at::Tensor& t, const char* name, int64_t h) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == h && t.stride(1) == 1, name,
              " must be [rows, ", h, "] with contiguous rows, got ", t.sizes(), " ", t.strides());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t h = weight.numel();
  check_rows(x, "x", h);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "weight must match x");
  at::Tensor out = at::empty({x.size(0), h}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    team::parallel_for(0, x.size(0), grain(h), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) norm_row(xp + t * xs, wp, op + t * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x (rounded to the dtype, as transformers' `x + attn_out`), then
// x = rms_norm(residual): vLLM's fused_add_rms_norm, both in place.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t h = weight.numel();
  check_rows(x, "x", h);
  check_rows(residual, "residual", h);
  TORCH_CHECK(x.size(0) == residual.size(0) && x.scalar_type() == residual.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "x, residual and weight must agree in rows and dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    team::parallel_for(0, x.size(0), grain(h), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        add_norm_row(xp + t * xs, rp + t * rs, wp, h, static_cast<float>(eps));
      }
    });
  });
}

// [rows, 2m] (gate | up) -> [rows, m]: silu(gate) * up, each rounded as torch rounds.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be [rows, 2m] with contiguous rows, got ", gate_up.sizes());
  const int64_t m = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), m}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t gs = gate_up.stride(0);
    team::parallel_for(0, gate_up.size(0), grain(2 * m), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        silu_mul_row(gp + t * gs, op + t * m, m);
      }
    });
  });
  return out;
}

// Rotate the first 2*half dims of every head of x [T, H, D] in place ("rotate_half"
// layout): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, cos/sin rounded to x's dtype
// first and each product and sum rounded, as transformers' apply_rotary_pos_emb.
template <typename T>
void rotate_heads(T* x, int64_t ts, int64_t hs, int64_t heads, const float* cos, const float* sin,
                  int64_t half, int64_t t) {
  const float* c = cos + t * half;
  const float* s = sin + t * half;
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + t * ts + h * hs;
    T* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float ci = r<T>(c[i]), si = r<T>(s[i]), a = f32(x1[i]), b = f32(x2[i]);
      x1[i] = to<T>(r<T>(a * ci) - r<T>(b * si));
      x2[i] = to<T>(r<T>(b * ci) + r<T>(a * si));
    }
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [T, heads, head_dim] with ",
              "contiguous heads, got ", t.sizes(), " ", t.strides());
}

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t tokens = q.size(0), half = cos.size(1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(0) == tokens &&
                  k.size(0) == tokens && 2 * half <= q.size(2) && 2 * half <= k.size(2) &&
                  q.scalar_type() == k.scalar_type(),
              "cos/sin must be contiguous float32 [T, rotary_dim/2] for q and k of one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    const int64_t row = (q.size(1) + k.size(1)) * 2 * half;
    team::parallel_for(0, tokens, grain(row), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        rotate_heads(qp, q.stride(0), q.stride(1), q.size(1), c, s, half, t);
        rotate_heads(kp, k.stride(0), k.stride(1), k.size(1), c, s, half, t);
      }
    });
  });
}

// ---- a linear layer over its weight in 16-column panels (linear_panels.h) -------------
// x [M, K] @ a weight laid out in panels ([ceil(N/16), K, 16], or for bf16 in pairs
// [ceil(N/16), K/2, 16, 2], linear_panels.h) + bias [N] or none, all bf16 or all fp32 ->
// [M, N] of the same dtype. `fma`: a pair layout's steps of kFmaWholeFrom rows and more
// (with AVX-512; else more than kWholeK) are multiplied by fp32 FMAs rather than bf16 dot
// products, to the same bits (`panels::gemm`'s ByFma; the other layouts' products are FMAs
// already). `prefetch_from`: the fewest rows of
// a whole-K step that prefetches the next panel; `whole_k_to`: the most rows a step runs
// whole K, unpacked (0: the build's kWholeK; linear_panels.h). All three are the CPU
// vendor's choices, made in one place (native/build.py: `pair_fma`, `prefetch_from`,
// `whole_k_to`).
void check_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                  int64_t n) {
  const auto dt = x.scalar_type();
  const bool pairs = panels.dim() == 4;
  TORCH_CHECK(x.dim() == 2 && (panels.dim() == 3 || (pairs && panels.size(3) == 2 && dt == at::kBFloat16)) &&
                  x.is_contiguous() && panels.is_contiguous() &&
                  (dt == at::kBFloat16 || dt == at::kFloat) && panels.scalar_type() == dt &&
                  panels.size(2) == panels::kNR && x.size(1) == panels.size(1) * (pairs ? 2 : 1) && n > 0 &&
                  n <= panels.size(0) * panels::kNR && n > (panels.size(0) - 1) * panels::kNR,
              "linear_panels takes contiguous x [M, K] and panels [ceil(N/16), K, 16], both bf16 or fp32, "
              "or bf16 pairs [ceil(N/16), K/2, 16, 2]");
  TORCH_CHECK(!bias || (bias->scalar_type() == dt && bias->is_contiguous() && bias->numel() == n),
              "bias must be a contiguous [N] of x's dtype");
}

// One weight's panels as `panels::gemm` reads them (check_panels has checked its tensor):
// np panels over an input of depth k (values, not pairs), fp32 or bf16, in pairs or not.
struct PanelWeight {
  const void* data;
  int64_t np, k;
  bool pairs, bf16;
};

// `panels` [np, K, 16] or pairs [np, K/2, 16, 2] (`index`: weight `index` of a stack of them,
// [E, np, ...]: a grouped op's expert).
PanelWeight panel_weight(const at::Tensor& panels, int64_t index = -1) {
  const int64_t d = index < 0 ? 0 : 1;  // the stack's dimension first
  const bool pairs = panels.dim() == 4 + d;
  const auto* base = static_cast<const char*>(panels.data_ptr());
  const int64_t offset = index < 0 ? 0 : index * panels.stride(0) * panels.element_size();
  return {base + offset, panels.size(d), panels.size(1 + d) * (pairs ? 2 : 1), pairs,
          panels.scalar_type() == at::kBFloat16};
}

// The input as the panels read it: a bf16 one as it is for pairs, else fp32 (a bf16 input
// widened once, here).
at::Tensor panel_input(const at::Tensor& x, bool pairs) {
  return pairs || x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
}

// m rows of `x` (`panel_input`'s: bf16 pairs for a pair weight, else fp32) times the panels
// in the layout's own way (bf16 pairs by dot products or by FMAs, else an fp32 input), each
// tile's sums handed to `finish` (`panels::gemm`).
template <typename F>
void panels_gemm(const void* x, int64_t m, const PanelWeight& w, bool fma, int64_t prefetch_from,
                 int64_t whole_k_to, F finish) {
  float* const c = nullptr;  // a finishing gemm keeps its own scratch
  const int64_t k = w.k, np = w.np;
  if (w.pairs) {  // the bf16 input as it is: K/2 pairs a row
    const auto* xp = static_cast<const panels::Pair*>(x);
    const auto* wp = static_cast<const panels::Pair*>(w.data);
#ifdef KVSERVE_KEYDIFF_AVX512
    // FMAs from kFmaWholeFrom rows (whole-K steps, up to kFmaWholeTo, need K in groups of
    // 32: every model's but toy ones; otherwise dot products up to there)
    const bool by_fma = fma && (m > panels::kFmaWholeTo || (m >= panels::kFmaWholeFrom && k % 32 == 0));
#else
    const bool by_fma = fma && m > panels::kWholeK;
#endif
    if (by_fma) {
      panels::gemm<panels::Pair, panels::Pair, F, true>(xp, m, k / 2, wp, np, c, prefetch_from, whole_k_to,
                                                        finish);
    } else {
      panels::gemm(xp, m, k / 2, wp, np, c, prefetch_from, whole_k_to, finish);
    }
    return;
  }
  const auto* xf = static_cast<const float*>(x);
  if (w.bf16) {
    panels::gemm(xf, m, k, static_cast<const at::BFloat16*>(w.data), np, c, prefetch_from, whole_k_to, finish);
  } else {
    panels::gemm(xf, m, k, static_cast<const float*>(w.data), np, c, prefetch_from, whole_k_to, finish);
  }
}

// The bias of a panel's columns as fp32, zeros past n (b: zeroed by the caller; nothing
// more to do without a bias, every layer of a Llama: this runs once a tile).
template <typename scalar_t>
void panel_bias(const scalar_t* bp, int64_t j0, int64_t cols, float* b) {
  for (int64_t j = 0; j < cols && bp; ++j) b[j] = f32(bp[j0 + j]);
}

// y [m, n] (rows contiguous) = m rows of x (`panel_input`'s) times one weight's panels,
// + bias bp [n] or none, rounded to the layer's dtype scalar_t: linear_panels' body, and
// each expert's of linear_panels_grouped.
template <typename scalar_t>
void panels_into(const void* x, int64_t m, const PanelWeight& w, const scalar_t* bp, int64_t n, bool fma,
                 int64_t prefetch_from, int64_t whole_k_to, scalar_t* yp) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (n == w.np * panels::kNR && !bp) {
      // fp32 without a bias over whole panels: the sums are the output, made in place
      panels::gemm(static_cast<const float*>(x), m, w.k, static_cast<const float*>(w.data), w.np, yp,
                   prefetch_from, whole_k_to);
      return;
    }
  }
  // A tile's sums (+ bias, rounded to the layer's dtype) into y, as soon as they are whole
  auto finish = [yp, bp, n](int, int64_t row, int64_t rows, int64_t first, int64_t count,
                            const float* sums, int64_t ldc) {
    for (int64_t panel = first; panel < first + count; ++panel, sums += panels::kNR) {
      const int64_t j0 = panel * panels::kNR, cols = std::min(panels::kNR, n - j0);
      float b[panels::kNR] = {};
      panel_bias(bp, j0, cols, b);
      for (int64_t r = 0; r < rows; ++r) {
        const float* s = sums + r * ldc;
        scalar_t* out = yp + (row + r) * n + j0;
#ifdef KVSERVE_KEYDIFF_AVX512
        if (cols == panels::kNR) {
          const __m512 v = _mm512_add_ps(_mm512_loadu_ps(s), _mm512_loadu_ps(b));
          if constexpr (std::is_same_v<scalar_t, float>) {
            _mm512_storeu_ps(out, v);
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16x16(v));
          }
          continue;
        }
#endif
        for (int64_t j = 0; j < cols; ++j) out[j] = to<scalar_t>(s[j] + b[j]);
      }
    }
  };
  panels_gemm(x, m, w, fma, prefetch_from, whole_k_to, finish);
}

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t n, bool fma, int64_t prefetch_from, int64_t whole_k_to) {
  check_panels(x, panels, bias, n);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const PanelWeight w = panel_weight(panels);
  const at::Tensor xin = panel_input(x, w.pairs);
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    panels_into(xin.data_ptr(), x.size(0), w, bias ? bias->data_ptr<scalar_t>() : nullptr, n, fma, prefetch_from,
                whole_k_to, y.data_ptr<scalar_t>());
  };
  if (x.scalar_type() == at::kFloat) run(float{}); else run(at::BFloat16{});
  return y;
}

// Many experts' linear layers over one input: x [N, K] holds each expert's rows one after
// the other (expert e's end at offs[e], int32, rising to N: the `offs` of torch._grouped_mm),
// panels [E, ceil(n/16), K, 16] (or bf16 pairs [E, ceil(n/16), K/2, 16, 2]) each expert's
// weight as `linear_panels` takes it, bias [E, n] or none -> y [N, n], expert e's rows
// through its own weight. The experts are looped over here, each through `panels_into`
// as linear_panels runs one layer (its team splitting the expert's panels, so two threads
// still share every expert's columns); an expert with no rows costs nothing. Why: ATen's
// grouped mm on the CPU is a loop of mm_out (MKL), which takes its slow paths on AMD CPUs
// (engine/models/moe.py has the measurements).
at::Tensor linear_panels_grouped(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& offs,
                                 const std::optional<at::Tensor>& bias, int64_t n, bool fma, int64_t prefetch_from,
                                 int64_t whole_k_to) {
  TORCH_CHECK((panels.dim() == 4 || panels.dim() == 5) && panels.size(0) > 0,
              "linear_panels_grouped takes panels [E, ceil(N/16), K, 16] or bf16 pairs [E, ceil(N/16), K/2, 16, 2]");
  const int64_t experts = panels.size(0), m = x.dim() == 2 ? x.size(0) : 0;
  check_panels(x, panels[0], std::nullopt, n);
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == experts && offs.scalar_type() == at::kInt && offs.is_cpu() &&
                  offs.is_contiguous(),
              "offs must be a contiguous int32 [E] of the experts' row ends, got ", offs.sizes(), " ",
              offs.scalar_type());
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->dim() == 2 &&
                        bias->size(0) == experts && bias->size(1) == n),
              "bias must be a contiguous [E, N] of x's dtype");
  const int32_t* ends = offs.data_ptr<int32_t>();
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(ends[e] >= (e ? ends[e - 1] : 0), "offs must rise: expert ", e, " ends at ", ends[e],
                " before ", e ? ends[e - 1] : 0);
  }
  TORCH_CHECK(ends[experts - 1] == m, "offs must end at x's rows (", m, "), got ", ends[experts - 1]);
  at::Tensor y = at::empty({m, n}, x.options());
  const at::Tensor xin = panel_input(x, panels.dim() == 5);
  const int64_t row_bytes = xin.size(1) * xin.element_size();
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    const auto* xp = static_cast<const char*>(xin.data_ptr());
    for (int64_t e = 0, start = 0; e < experts; start = ends[e++]) {
      if (ends[e] == start) continue;
      panels_into(xp + start * row_bytes, ends[e] - start, panel_weight(panels, e), bp ? bp + e * n : nullptr, n,
                  fma, prefetch_from, whole_k_to, yp + start * n);
    }
  };
  if (x.scalar_type() == at::kFloat) run(float{}); else run(at::BFloat16{});
  return y;
}

// `linear_panels(...).float().max(dim=-1).indices` without the output: the first column of
// each row's largest value, rounded to the layer's dtype as the output holds it (torch's
// rule: the first of equal maxima, and a NaN counts as the largest, the first one wins).
// Each tile's sums, while in L1, update its share's running maximum per row and lane (lane
// j: column j of every panel; a panel replaces a lane's value only when it is larger, so
// the first panel of equal ones stays, and a lane's first NaN stays), and the shares'
// lanes are reduced at the end. A wide tile's two panels are compared in registers first
// and update the row's lanes once (the 3M model's head at 64 rows: what the maximum adds
// to the head, 95 -> ~40 us, against ~45 for reading the logits back). Why: a greedy step
// wrote logits that the sampler then read back from out of cache (the head's weights
// stream through L2 meanwhile); a bf16 head also copied them to fp32 first: the 160M
// model's bf16 head and argmax at 64 rows take ~0.9x the time this way, its decode step
// 1.02x (engine/cpu_linear.py's `greedy_ids`).
at::Tensor linear_panels_argmax(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                                int64_t n, bool fma, int64_t prefetch_from, int64_t whole_k_to) {
  check_panels(x, panels, bias, n);
  const int64_t m = x.size(0), lanes = panels::kNR;
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  if (m == 0) return out;
  // a share's lanes for every row: the largest value, its panel (-1: none larger than
  // -inf yet) and which lanes met a NaN (a bit each); `gemm` runs at most
  // get_num_threads() shares. Each row's lanes are one cache line, aligned (ATen's
  // allocator): a row's next panel may read what its last one stored right after, and a
  // store forwards to a load only within one line.
  const int64_t shares = std::max(1, at::get_num_threads());
  at::Tensor best_t = at::full({shares * m, lanes}, -INFINITY, x.options().dtype(at::kFloat));
  at::Tensor at_t = at::full({shares * m, lanes}, -1, x.options().dtype(at::kInt));
  at::Tensor nan_t = at::zeros({shares * m}, x.options().dtype(at::kShort));
  float* best = best_t.data_ptr<float>();
  int32_t* at_panel = at_t.data_ptr<int32_t>();
  uint16_t* nan = reinterpret_cast<uint16_t*>(nan_t.data_ptr<int16_t>());
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
    // One panel's values of a row (bias added, rounded as the output holds them) into
    // its share's lanes o: the general rule, NaN included.
    auto one = [&](int64_t o, int64_t panel, const float* s, const float* b, int64_t cols) {
      float* bv = best + o * lanes;
      int32_t* ap = at_panel + o * lanes;
      const int32_t p = static_cast<int32_t>(panel);
      for (int64_t j = 0; j < cols; ++j) {
        const float v = std::is_same_v<scalar_t, float> ? s[j] + b[j] : f32(to<scalar_t>(s[j] + b[j]));
        if (nan[o] >> j & 1) continue;
        if (v != v) {
          nan[o] |= static_cast<uint16_t>(1u << j);
          ap[j] = p;
        } else if (v > bv[j]) {
          bv[j] = v;
          ap[j] = p;
        }
      }
    };
    auto finish = [&](int share, int64_t row, int64_t rows, int64_t first, int64_t count,
                      const float* sums, int64_t ldc) {
      const int64_t j0 = first * lanes, cols = std::min(count * lanes, n - j0);
      float b[2 * panels::kNR] = {};
      panel_bias(bp, j0, cols, b);
#ifdef KVSERVE_KEYDIFF_AVX512
      // A whole panel's values of a row as the output holds them (bias added, rounded).
      auto held = [&](const float* s, const float* bq) {
        __m512 v = _mm512_loadu_ps(s);
        if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bq));
        if constexpr (!std::is_same_v<scalar_t, float>) {
          v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
        }
        return v;
      };
      if (cols == count * lanes) {  // whole panels, one or a wide tile's two
        const __m512i p0 = _mm512_set1_epi32(static_cast<int32_t>(first));
        const __m512i p1 = _mm512_set1_epi32(static_cast<int32_t>(first + 1));
        for (int64_t r = 0; r < rows; ++r) {
          const float* s = sums + r * ldc;
          const int64_t o = share * m + row + r;
          __m512 v = held(s, b), v1 = count == 2 ? held(s + lanes, b + lanes) : v;
          if ((_mm512_cmp_ps_mask(v, v1, _CMP_UNORD_Q) | nan[o]) != 0) {  // a NaN: one by one
            for (int64_t q = 0; q < count; ++q) one(o, first + q, s + q * lanes, b + q * lanes, lanes);
            continue;
          }
          // two panels' maximum per lane first, in registers: the later panel only where
          // strictly larger, so the first of equal values stays
          const __mmask16 later = count == 2 ? _mm512_cmp_ps_mask(v1, v, _CMP_GT_OQ) : 0;
          v = _mm512_mask_mov_ps(v, later, v1);
          float* bv = best + o * lanes;
          int32_t* ap = at_panel + o * lanes;
          const __m512 cur = _mm512_load_ps(bv);
          const __mmask16 larger = _mm512_cmp_ps_mask(v, cur, _CMP_GT_OQ);
          _mm512_store_ps(bv, _mm512_mask_mov_ps(cur, larger, v));
          const __m512i at = _mm512_load_si512(ap);
          _mm512_store_si512(ap, _mm512_mask_mov_epi32(at, larger, _mm512_mask_mov_epi32(p0, later, p1)));
        }
        return;
      }
#endif
      for (int64_t r = 0; r < rows; ++r) {
        const float* s = sums + r * ldc;
        for (int64_t q = 0; q < count && q * lanes < cols; ++q)
          one(share * m + row + r, first + q, s + q * lanes, b + q * lanes, std::min(lanes, cols - q * lanes));
      }
    };
    const PanelWeight w = panel_weight(panels);
    panels_gemm(panel_input(x, w.pairs).data_ptr(), m, w, fma, prefetch_from, whole_k_to, finish);
  };
  if (x.scalar_type() == at::kFloat) run(float{}); else run(at::BFloat16{});
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < m; ++row) {
    // columns rise with the share and, within one, with the panel: the smallest column
    // among the NaN lanes, else among the lanes holding the largest value
    int64_t first_nan = -1, first = -1;
    float top = -INFINITY;
    for (int64_t sh = 0; sh < shares; ++sh) {
      const int64_t o = (sh * m + row) * lanes;
      for (int64_t j = 0; j < lanes; ++j) {
        if (at_panel[o + j] < 0) continue;
        const int64_t col = at_panel[o + j] * lanes + j;
        if (nan[sh * m + row] >> j & 1) {
          if (first_nan < 0 || col < first_nan) first_nan = col;
        } else if (best[o + j] > top || (best[o + j] == top && col < first)) {
          top = best[o + j];
          first = col;
        }
      }
    }
    op[row] = first_nan >= 0 ? first_nan : std::max<int64_t>(first, 0);  // a row of -inf: 0
  }
  return out;
}

// panels::isa(): "avx2" / "avx512" / "avx512_bf16" where the panels' tiles have their
// vector loops in this build, else "scalar" (no match for oneDNN: engine/cpu_linear.py then
// leaves linear layers to it).
std::string linear_panels_isa() { return panels::isa(); }

}  // namespace

TORCH_LIBRARY(kvserve_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("linear_panels(Tensor x, Tensor panels, Tensor? bias, int n, bool fma=False, int prefetch_from=6, "
        "int whole_k_to=0) -> Tensor");
  m.def("linear_panels_grouped(Tensor x, Tensor panels, Tensor offs, Tensor? bias, int n, bool fma=False, "
        "int prefetch_from=6, int whole_k_to=0) -> Tensor");
  m.def("linear_panels_argmax(Tensor x, Tensor panels, Tensor? bias, int n, bool fma=False, "
        "int prefetch_from=6, int whole_k_to=0) -> Tensor");
  m.def("linear_panels_isa() -> str");
}

TORCH_LIBRARY_IMPL(kvserve_layer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("linear_panels", &linear_panels);
  m.impl("linear_panels_grouped", &linear_panels_grouped);
  m.impl("linear_panels_argmax", &linear_panels_argmax);
}

// No tensor argument to dispatch on: registered as a catch-all.
TORCH_LIBRARY_FRAGMENT(kvserve_layer, m) {
  m.impl("linear_panels_isa", &linear_panels_isa);
}
