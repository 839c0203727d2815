// Per-slot state updates of the decode-time policies, in place, one pass per row.
//
// Registered as torch.ops.kvserve_policy_state.*; kvpool/policy_rows.py builds it on
// first use beside the selection (select_cpu.cpp) and the policies keep a torch form
// without it. Why kernels: a decode step updates every live slot's state from one
// query, a dozen element-wise torch sweeps over [rows, slots] each (lazy_eviction), or
// a scatter into and a sum over 32 values per slot that the engine copied out of its
// tables and back (pyramid's window ring: 8 MB each way at 16 requests of ~1k tokens).
// Here the state is read and written where the tables keep it (the view hands it as a
// [L, R, W(, k)] slice), and only the values the step changes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "live_slots.h"
#include "../../native/csrc/window_ring.h"
#include "../../native/csrc/team.h"

#if defined(KVSERVE_LIVE16) && defined(__AVX512DQ__)  // live16: live_slots.h
#define KVSERVE_AVX512 1
#endif

namespace {

using live_slots::lowest;  // live_slots.h (select_cpu.cpp's too)
using live_slots::Rows;
using live_slots::rows_of;
#ifdef KVSERVE_LIVE16
using live_slots::live16;
#endif

// Append every live slot j of [a, b) with double(s[j]) <= thr, in slot order; 16 slots
// a compare with AVX-512 (a hit is rare: the few near a row's lowest).
inline void live_at_most(const float* s, const int64_t* pos, int64_t a, int64_t b, double thr,
                         std::vector<int64_t>& slots) {
  int64_t j = a;
#ifdef KVSERVE_AVX512
  const __m512d t = _mm512_set1_pd(thr);
  for (; j + 16 <= b; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    const __mmask8 lo = _mm512_cmp_pd_mask(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), t, _CMP_LE_OQ);
    const __mmask8 hi = _mm512_cmp_pd_mask(
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), t, _CMP_LE_OQ);
    unsigned hit = live16(pos, j) & (lo | (static_cast<unsigned>(hi) << 8));
    for (; hit; hit &= hit - 1) slots.push_back(j + __builtin_ctz(hit));
  }
#endif
  for (; j < b; ++j)
    if (pos[j] >= 0 && static_cast<double>(s[j]) <= thr) slots.push_back(j);
}

void check_rows(const at::Tensor& state, int64_t n, int64_t w, const char* what) {
  TORCH_CHECK(state.dim() >= 3 && state.size(0) * state.size(1) == n && state.size(2) == w,
              what, " must be [L, R, W, ...] with L * R rows of W slots");
  TORCH_CHECK(state.scalar_type() == at::kFloat, what, " must be float32");
}

// Pyramid's window (policies/pyramid.py::_window_ring, whose torch form this is):
// write this step's window queries' mass into their ring columns and keep each slot's
// window total exact in fixed point (window_ring.h, which the decode kernel shares), so
// a step touches the written column and the total instead of the whole ring.
// ring: [L, R, W, a] and total [L, R, W, 3], any strides (slices of the tables: the
// ring stored by columns, so a column of a row is contiguous); mass [L·R, k, W]; cols
// [L·R, k] (distinct per row). Returns, if `want`, each live slot's total as float32
// (one rounding of the int64, then an exact power-of-two scale), 0 on dead slots.
using window_ring::fixed;

struct RingRow {
  float* ring;  // slot s, column q at s * r2 + q * r3
  float* total;  // slot s, digit d at s * t2 + d * t3
  const float* mass;  // [k, W]
  const int64_t* cols;  // [k]
  const int64_t* pos;  // [W]
  float* out;  // [W] or null
};

// One row of `window_ring`; inlined with unit strides for the tables' column layout.
inline __attribute__((always_inline)) void ring_row(
    const RingRow& row, int64_t* sum, int64_t w, int64_t k, int64_t r2, int64_t r3,
    int64_t t2, int64_t t3, double up, float down, int64_t mass_stride = -1) {
  const int64_t ms = mass_stride < 0 ? w : mass_stride;  // between a row's query rows
  for (int64_t s = 0; s < w; ++s) sum[s] = window_ring::load(row.total + s * t2, t3);
  for (int64_t j = 0; j < k; ++j) {
    float* col = row.ring + row.cols[j] * r3;
    const float* mj = row.mass + j * ms;
    for (int64_t s = 0; s < w; ++s) {
      sum[s] += fixed(mj[s], up) - fixed(col[s * r2], up);
      col[s * r2] = mj[s];
    }
  }
  if (k)
    for (int64_t s = 0; s < w; ++s) window_ring::store(row.total + s * t2, t3, sum[s]);
  if (row.out != nullptr)
    for (int64_t s = 0; s < w; ++s) {  // both sides computed: a select, not a branch
      const float v = static_cast<float>(sum[s]) * down;
      row.out[s] = row.pos[s] >= 0 ? v : 0.0f;
    }
}

#ifdef WINDOW_RING_LANES8
// `ring_row` for the tables' column layout (unit slot strides), 8 slots at a time
// (window_ring.h's 8-lane forms, AVX-512 or AVX2: the same bits).
inline void ring_row8(const RingRow& row, int64_t* sum, int64_t w, int64_t k, int64_t r3,
                      int64_t t3, double up, float down) {
  const auto upv = window_ring::splat(up);
#ifdef WINDOW_RING_AVX512
  const __m256 downv = _mm256_set1_ps(down);
#endif
  int64_t s = 0;
  for (; s + 8 <= w; s += 8) {
    auto v = window_ring::load8(row.total + s, t3);
    for (int64_t j = 0; j < k; ++j)
      v = window_ring::put8(row.ring + row.cols[j] * r3 + s, row.mass + j * w + s, v, upv);
    if (k) window_ring::store8(row.total + s, t3, v);
    if (row.out != nullptr) {
#ifdef WINDOW_RING_AVX512
      const __mmask8 live = _mm512_cmpge_epi64_mask(_mm512_loadu_si512(row.pos + s), _mm512_setzero_si512());
      _mm256_storeu_ps(row.out + s, _mm256_maskz_mul_ps(live, _mm512_cvtepi64_ps(v), downv));
#else  // AVX2 converts no int64 to float: the scalar conversion of each total
      window_ring::store_sums(sum + s, v);
      for (int64_t i = s; i < s + 8; ++i) {
        const float x = static_cast<float>(sum[i]) * down;
        row.out[i] = row.pos[i] >= 0 ? x : 0.0f;
      }
#endif
    }
  }
  if (s < w) {  // the last slots, as ring_row does them
    const RingRow tail{row.ring + s, row.total + s, row.mass + s, row.cols, row.pos + s,
                       row.out == nullptr ? nullptr : row.out + s};
    ring_row(tail, sum, w - s, k, 1, r3, 1, t3, up, down, w);
  }
}
#endif

// LazyEviction's Recurrence Interval Tracking for one query per row (a decode step;
// policies/lazy_eviction.py::_tracked, whose torch form this is): a slot is activated
// when mass / total >= alpha (float32, as `head_mean` divides), it is live and not
// after the query; then MRI = max(MRI, t - TS), TS = max(TS, t). A NaN TS (not seen
// yet) becomes the slot's birth time first. ts, mri: [L, R, W] float32 (any strides
// over L and R), updated in place; mass [N, W], total [N] (N = L·R rows, row i is
// request i % R); qpos, prompt [R]: each request's query position and prompt length.
void lazy_track(at::Tensor ts, at::Tensor mri, const at::Tensor& mass, const at::Tensor& total,
                const at::Tensor& positions, at::IntArrayRef qpos, at::IntArrayRef prompt,
                double alpha) {
  const Rows<int64_t> pr = rows_of<int64_t>(positions, "positions");
  const int64_t n = pr.n, w = pr.w;
  check_rows(ts, n, w, "ts");
  check_rows(mri, n, w, "mri");
  TORCH_CHECK(ts.dim() == 3 && mri.dim() == 3 && ts.stride(2) == 1 && mri.stride(2) == 1 &&
              ts.size(1) == mri.size(1), "ts and mri must be [L, R, W] with slots contiguous");
  TORCH_CHECK(mass.dim() == 2 && mass.size(0) == n && mass.size(1) == w &&
              mass.scalar_type() == at::kFloat, "mass must be [N, W] float32");
  TORCH_CHECK(total.dim() == 1 && total.size(0) == n && total.scalar_type() == at::kFloat,
              "total must be [N] float32");
  const int64_t r = ts.size(1);
  TORCH_CHECK(static_cast<int64_t>(qpos.size()) == r && static_cast<int64_t>(prompt.size()) == r,
              "qpos and prompt must hold one value a request");
  const at::Tensor m = mass.contiguous(), tot = total.contiguous();
  float *tp = ts.data_ptr<float>(), *mp = mri.data_ptr<float>();
  const float* ap = m.data_ptr<float>();
  const float* sp = tot.data_ptr<float>();
  const float a32 = static_cast<float>(alpha);  // torch compares a float32 tensor in float32
  team::parallel_for(0, n, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* tsr = tp + (i / r) * ts.stride(0) + (i % r) * ts.stride(1);
      float* mr = mp + (i / r) * mri.stride(0) + (i % r) * mri.stride(1);
      const float* ai = ap + i * w;
      const int64_t* pi = pr.row(i);
      const float den = sp[i];
      const int64_t qi = qpos[i % r], pl = prompt[i % r];
      const double t = static_cast<double>(qi - pl + 1);
      int64_t s = 0;
#ifdef KVSERVE_AVX512
      // 8 slots at a time in double, each step as the scalar loop takes it (the same
      // division, compares and roundings; std::max(a, b) as a < b ? b : a): the same
      // bits. Scalar, the branches on NaN and activation were ~2.5 ns a slot.
      const __m256 denv = _mm256_set1_ps(den), av = _mm256_set1_ps(a32);
      const __m512i qv = _mm512_set1_epi64(qi), zero = _mm512_setzero_si512();
      const __m512i born = _mm512_set1_epi64(pl - 1);
      const __m512d tv = _mm512_set1_pd(t);
      for (; s + 8 <= w; s += 8) {
        const __m512i pos = _mm512_loadu_si512(pi + s);
        __m512d old = _mm512_cvtps_pd(_mm256_loadu_ps(tsr + s));
        old = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(old, old, _CMP_UNORD_Q), old,
                                   _mm512_cvtepi64_pd(_mm512_sub_epi64(pos, born)));
        const __mmask8 act =
            _mm256_cmp_ps_mask(_mm256_div_ps(_mm256_loadu_ps(ai + s), denv), av, _CMP_GE_OQ) &
            _mm512_cmple_epi64_mask(pos, qv) & _mm512_cmpge_epi64_mask(pos, zero);
        const __m512d was = _mm512_cvtps_pd(_mm256_loadu_ps(mr + s)), gap = _mm512_sub_pd(tv, old);
        const __m512d most = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(was, gap, _CMP_LT_OQ), was, gap);
        _mm256_mask_storeu_ps(mr + s, act, _mm512_cvtpd_ps(most));
        const __m512d later = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(old, tv, _CMP_LT_OQ), old, tv);
        _mm256_storeu_ps(tsr + s, _mm512_cvtpd_ps(_mm512_mask_blend_pd(act, old, later)));
      }
#elif defined(__AVX2__)
      // The same 4 slots at a time (AVX2: doubles 4 to a vector; the positions' int64
      // made double by the 2^52 + 2^51 trick, exact below 2^51; compares as masks).
      const __m128 denv = _mm_set1_ps(den), av = _mm_set1_ps(a32);
      const __m256i qv = _mm256_set1_epi64x(qi), zero = _mm256_setzero_si256();
      const __m256i born = _mm256_set1_epi64x(pl - 1);
      const __m256d tv = _mm256_set1_pd(t), magic = _mm256_set1_pd(6755399441055744.0);
      const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
      for (; s + 4 <= w; s += 4) {
        const __m256i pos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pi + s));
        const __m256d birth = _mm256_sub_pd(
            _mm256_castsi256_pd(_mm256_add_epi64(_mm256_sub_epi64(pos, born), _mm256_castpd_si256(magic))),
            magic);
        __m256d old = _mm256_cvtps_pd(_mm_loadu_ps(tsr + s));
        old = _mm256_blendv_pd(old, birth, _mm256_cmp_pd(old, old, _CMP_UNORD_Q));
        const __m256i in = _mm256_andnot_si256(  // pos <= qi and pos >= 0
            _mm256_or_si256(_mm256_cmpgt_epi64(pos, qv), _mm256_cmpgt_epi64(zero, pos)),
            _mm256_set1_epi64x(-1));
        const __m128 act = _mm_and_ps(  // 4 lanes of 32 bits
            _mm_cmp_ps(_mm_div_ps(_mm_loadu_ps(ai + s), denv), av, _CMP_GE_OQ),
            _mm_castsi128_ps(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(in, even))));
        const __m256d act64 = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm_castps_si128(act)));
        const __m128 was32 = _mm_loadu_ps(mr + s);
        const __m256d was = _mm256_cvtps_pd(was32), gap = _mm256_sub_pd(tv, old);
        const __m256d most = _mm256_blendv_pd(was, gap, _mm256_cmp_pd(was, gap, _CMP_LT_OQ));
        _mm_storeu_ps(mr + s, _mm_blendv_ps(was32, _mm256_cvtpd_ps(most), act));
        const __m256d later = _mm256_blendv_pd(old, tv, _mm256_cmp_pd(old, tv, _CMP_LT_OQ));
        _mm_storeu_ps(tsr + s, _mm256_cvtpd_ps(_mm256_blendv_pd(old, later, act64)));
      }
#endif
      for (; s < w; ++s) {
        double old = tsr[s];
        if (std::isnan(old)) old = static_cast<double>(pi[s] - pl + 1);
        const bool act = ai[s] / den >= a32 && pi[s] <= qi && pi[s] >= 0;
        if (act) {
          mr[s] = static_cast<float>(std::max(static_cast<double>(mr[s]), t - old));
          old = std::max(old, t);
        }
        tsr[s] = static_cast<float>(old);
      }
    }
  });
}

#ifdef KVSERVE_AVX512
// torch's own exp for 8 doubles (Vectorized<double>::exp on AVX-512, exported by
// libtorch_cpu): the torch form's exps are these bits. Weak: a torch without the symbol
// leaves it null, and std::exp serves (the same float32 scores but in rare last bits).
extern "C" __m512d Sleef_expd8_u10(__m512d) __attribute__((weak));
#elif defined(__AVX2__) && defined(__FMA__)
// The same for 4 doubles (Vectorized<double>::exp on AVX2, torch's kernels on a CPU
// without AVX-512).
extern "C" __m256d Sleef_expd4_u10(__m256d) __attribute__((weak));
#endif

// LazyEviction's importance I_t (004_a0d6af55e6947072.txt eq. 2;
// policies/lazy_eviction.py::importance, whose torch form this is) of every slot of the
// deciding rows, as the selection reads it (float32): H1 = 2σ(-(t - TS)/MRI) (1 at
// t = TS, 0 at MRI = 0 < t - TS) plus H2 = 2σ(-1/(MRI - 1)) (0 at MRI = 0 and 1), in
// double, each σ(v) as torch's vector kernel takes it: 1 / (1 + exp(0 - v)). One pass
// instead of a gather, two casts and a dozen sweeps over [M, W] in double.
// ts, mri [L, R, W] float32 (slots contiguous); rows: the deciding rows (l·R + r); t:
// each one's time. Returns [L·R, W] float32, the other rows 0: the selection takes it
// whole with no drops in those rows, where a gather of the deciding rows' positions and
// a plan scattered back into [L·R, W] were two more passes (and an OpenMP wake-up).
at::Tensor lazy_importance(const at::Tensor& ts, const at::Tensor& mri, at::IntArrayRef rows,
                           at::IntArrayRef t) {
  TORCH_CHECK(ts.dim() == 3 && mri.sizes() == ts.sizes() && ts.stride(2) == 1 &&
                  mri.stride(2) == 1 && ts.scalar_type() == at::kFloat &&
                  mri.scalar_type() == at::kFloat,
              "ts and mri must be [L, R, W] float32 with slots contiguous");
  TORCH_CHECK(rows.size() == t.size(), "one time a row");
  const int64_t r = ts.size(1), w = ts.size(2), m = rows.size();
  for (const int64_t i : rows) TORCH_CHECK(i >= 0 && i < ts.size(0) * r, "row out of range");
  at::Tensor out = team::zeros({ts.size(0) * r, w}, ts.options());
  float* op = out.data_ptr<float>();
  const auto h = [](double x, double y) {  // 2σ(-x) + (2σ(-y) or 0), x, y as below
    return 2.0 * (1.0 / (1.0 + std::exp(0.0 - -x))) + y;
  };
  for (int64_t k = 0; k < m; ++k) {
    const int64_t i = rows[k];
    const float* tr = ts.data_ptr<float>() + (i / r) * ts.stride(0) + (i % r) * ts.stride(1);
    const float* mr = mri.data_ptr<float>() + (i / r) * mri.stride(0) + (i % r) * mri.stride(1);
    const double tk = static_cast<double>(t[k]);
    float* o = op + i * w;
    int64_t s = 0;
#ifdef KVSERVE_AVX512
    if (Sleef_expd8_u10 != nullptr) {
      const __m512d zero = _mm512_setzero_pd(), one = _mm512_set1_pd(1.0), two = _mm512_set1_pd(2.0);
      const __m512d inf = _mm512_set1_pd(INFINITY), tv = _mm512_set1_pd(tk);
      const auto sigma2 = [&](__m512d x) {  // 2σ(-x) = 2 · 1 / (1 + exp(0 - (-x)))
        const __m512d v = _mm512_sub_pd(zero, x);
        return _mm512_mul_pd(two, _mm512_div_pd(one, _mm512_add_pd(one, Sleef_expd8_u10(_mm512_sub_pd(zero, v)))));
      };
      for (; s + 8 <= w; s += 8) {
        const __m512d e = _mm512_sub_pd(tv, _mm512_cvtps_pd(_mm256_loadu_ps(tr + s)));
        const __m512d mm = _mm512_cvtps_pd(_mm256_loadu_ps(mr + s));
        const __mmask8 m0 = _mm512_cmp_pd_mask(mm, zero, _CMP_EQ_OQ);
        const __mmask8 m1 = _mm512_cmp_pd_mask(mm, one, _CMP_EQ_OQ);
        // x1 = e == 0 ? 0 : (mri == 0 ? inf : e / max(mri, 1)); torch's clamp_min keeps a NaN
        const __m512d den = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(mm, one, _CMP_LT_OQ), mm, one);
        __m512d x1 = _mm512_mask_blend_pd(m0, _mm512_div_pd(e, den), inf);
        x1 = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(e, zero, _CMP_EQ_OQ), x1, zero);
        const __m512d x2 = _mm512_mask_blend_pd(m1, _mm512_div_pd(one, _mm512_sub_pd(mm, one)), inf);
        const __m512d h2 = _mm512_mask_blend_pd(m0, sigma2(x2), zero);
        _mm256_storeu_ps(o + s, _mm512_cvtpd_ps(_mm512_add_pd(sigma2(x1), h2)));
      }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (Sleef_expd4_u10 != nullptr) {  // the AVX-512 form's steps, 4 slots at a time
      const __m256d zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0), two = _mm256_set1_pd(2.0);
      const __m256d inf = _mm256_set1_pd(INFINITY), tv = _mm256_set1_pd(tk);
      const auto sigma2 = [&](__m256d x) {  // 2σ(-x) = 2 · 1 / (1 + exp(0 - (-x)))
        const __m256d v = _mm256_sub_pd(zero, x);
        return _mm256_mul_pd(two, _mm256_div_pd(one, _mm256_add_pd(one, Sleef_expd4_u10(_mm256_sub_pd(zero, v)))));
      };
      for (; s + 4 <= w; s += 4) {
        const __m256d e = _mm256_sub_pd(tv, _mm256_cvtps_pd(_mm_loadu_ps(tr + s)));
        const __m256d mm = _mm256_cvtps_pd(_mm_loadu_ps(mr + s));
        const __m256d m0 = _mm256_cmp_pd(mm, zero, _CMP_EQ_OQ);
        const __m256d m1 = _mm256_cmp_pd(mm, one, _CMP_EQ_OQ);
        // x1 = e == 0 ? 0 : (mri == 0 ? inf : e / max(mri, 1)); torch's clamp_min keeps a NaN
        const __m256d den = _mm256_blendv_pd(mm, one, _mm256_cmp_pd(mm, one, _CMP_LT_OQ));
        __m256d x1 = _mm256_blendv_pd(_mm256_div_pd(e, den), inf, m0);
        x1 = _mm256_blendv_pd(x1, zero, _mm256_cmp_pd(e, zero, _CMP_EQ_OQ));
        const __m256d x2 = _mm256_blendv_pd(_mm256_div_pd(one, _mm256_sub_pd(mm, one)), inf, m1);
        const __m256d h2 = _mm256_blendv_pd(sigma2(x2), zero, m0);
        _mm_storeu_ps(o + s, _mm256_cvtpd_ps(_mm256_add_pd(sigma2(x1), h2)));
      }
    }
#endif
    for (; s < w; ++s) {
      const double e = tk - static_cast<double>(tr[s]), mm = mr[s];
      const double x1 = e == 0.0 ? 0.0 : mm == 0.0 ? INFINITY : e / (mm < 1.0 ? 1.0 : mm);
      const double x2 = mm == 1.0 ? INFINITY : 1.0 / (mm - 1.0);
      const double h2 = mm == 0.0 ? 0.0 : h(x2, 0.0);
      o[s] = static_cast<float>(h(x1, h2));
    }
  }
  return out;
}

// Pyramid's selection ranks by the window's float32 sum as torch sums it (the ring's α
// values in torch's order), which can differ from the exact total in its last bits and
// so break near ties differently. Only candidates near a row's d-th lowest can be
// dropped: the candidates (live slots outside the first and last `edge` live ones)
// whose exact total is at most the d-th lowest candidate's times (1 + rel) plus `abs`
// (rel and abs bound the float32 sum's error and the total's rounding,
// policies/pyramid.py::PyramidPolicy._shift_window). Appends those slots, in slot order.
constexpr int64_t kFewDrops = 8;  // up to this many drops a row: no copy, no nth_element

void near_lowest(const float* s, const int64_t* pos, int64_t w, int64_t edge, int64_t drop,
                 double rel, double abs, std::vector<int64_t>& slots, std::vector<float>& vals) {
  const auto [a, b] = live_slots::candidates(pos, w, edge, edge);  // as select_row's
  float kth = INFINITY;  // the d-th lowest candidate total
  if (drop == 1) {  // decode at the budget: the lowest, one vectorised pass
    kth = lowest(s, pos, a, b);
    if (kth == INFINITY) return;
  } else if (drop <= kFewDrops) {  // a few: the d lowest kept sorted, most slots one compare
    float low[kFewDrops];
    std::fill(low, low + drop, INFINITY);
    int64_t live = 0;
    for (int64_t j = a; j < b; ++j) {
      if (pos[j] < 0) continue;
      ++live;
      const float v = s[j];
      if (!(v < low[drop - 1])) continue;
      int64_t k = drop - 1;
      for (; k > 0 && low[k - 1] > v; --k) low[k] = low[k - 1];
      low[k] = v;
    }
    if (live == 0) return;
    kth = low[std::min(drop, live) - 1];
  } else {
    vals.clear();
    for (int64_t j = a; j < b; ++j)
      if (pos[j] >= 0) vals.push_back(s[j]);
    if (vals.empty()) return;
    const int64_t k = std::min<int64_t>(drop, vals.size()) - 1;
    std::nth_element(vals.begin(), vals.begin() + k, vals.end());
    kth = vals[k];
  }
  live_at_most(s, pos, a, b, static_cast<double>(kth) * (1.0 + rel) + abs, slots);
}

// Mark the drop lowest of one row's candidates (`slots`, ascending; `values` their
// sums) in `out` [W], ties toward the later slot: the selection `drop_lowest` makes over
// a whole row, here over the only slots of it that can be dropped.
void drop_among(const int64_t* slots, const float* values, int64_t m, int64_t drop, bool* out,
                std::vector<int64_t>& idx) {
  idx.resize(m);
  for (int64_t k = 0; k < m; ++k) idx[k] = k;
  // ascending value, a NaN above every number, ties: the later slot first
  std::sort(idx.begin(), idx.end(), [&](int64_t x, int64_t y) {
    const bool nx = std::isnan(values[x]), ny = std::isnan(values[y]);
    if (nx != ny) return !nx;
    if (!nx && values[x] != values[y]) return values[x] < values[y];
    return slots[x] > slots[y];
  });
  for (int64_t k = 0; k < std::min(std::max<int64_t>(drop, 0), m); ++k) out[slots[idx[k]]] = true;
}

}  // namespace

// Pyramid's step, one pass per row (policies/pyramid.py::PyramidPolicy.select; its torch
// form: `_window_ring`, then `keep_highest` over `_torch_sums`): write this step's window
// queries' mass into their ring columns and keep each slot's window total exact (above),
// then, in the rows that must drop (drop[i] > 0), find the candidates near the lowest
// total (`near_lowest`) while the row's totals are in cache; where a row has more
// candidates than drops, sum those candidates' rings as torch sums them (their [M, α]
// values copied out of the tables' column layout, then torch's own sum over dim 1: the
// same kernel, the same bits as the torch form's sums), and mark the drop[i] lowest
// among them; else mark every candidate. One op instead of four and the Python between
// them: after the forward, each distinct op of a policy step starts cold.
// ring [L, R, W, α], total [L, R, W, 3] (any strides); mass [L·R, k, W]; cols [L·R·k]
// (row i's k columns, distinct); positions [L·R, W] or [L, R, W] (`Rows`); edges, drop [L·R] or drop empty
// (update only). `rows` [R], or empty: ring and total are [L, Rt, W, ...] tensors of
// every table row and request r's row is rows[r] (a group whose rows are not
// consecutive, read in place: `RowsView.whole`). Returns the drop mask [L·R, W], or
// [0, W] when drop is empty.
at::Tensor pyramid_window(at::Tensor ring, at::Tensor total, const at::Tensor& mass,
                          at::IntArrayRef cols, const at::Tensor& positions,
                          at::IntArrayRef edges, at::IntArrayRef drop, int64_t shift,
                          double rel, double abs, at::IntArrayRef rows) {
  const Rows<int64_t> pr = rows_of<int64_t>(positions, "positions");
  const int64_t n = pr.n, w = pr.w;
  if (rows.empty()) {
    check_rows(ring, n, w, "ring");
    check_rows(total, n, w, "total");
  } else {
    for (const at::Tensor* t : {&ring, &total})
      TORCH_CHECK(t->dim() == 4 && t->size(0) * static_cast<int64_t>(rows.size()) == n &&
                      t->size(2) == w && t->scalar_type() == at::kFloat,
                  "ring and total must be [L, Rt, W, ...] float32 with L * len(rows) = N");
    for (const int64_t x : rows) TORCH_CHECK(x >= 0 && x < ring.size(1), "row out of range");
  }
  TORCH_CHECK(ring.dim() == 4 && total.dim() == 4 && total.size(3) == 3 &&
              total.size(1) == ring.size(1), "ring must be [L, R, W, a], total [L, R, W, 3]");
  TORCH_CHECK(mass.dim() == 3 && mass.size(0) == n && mass.size(2) == w &&
              mass.scalar_type() == at::kFloat, "mass must be [N, k, W] float32");
  const int64_t a = ring.size(3), k = mass.size(1);
  const int64_t r = rows.empty() ? ring.size(1) : static_cast<int64_t>(rows.size());
  // view row i (layer i / r, request i % r) at its table row
  const auto row_of = [&](int64_t i) { return rows.empty() ? i % r : rows[i % r]; };
  TORCH_CHECK(static_cast<int64_t>(cols.size()) == n * k, "cols must hold N * k columns");
  for (const int64_t c : cols) TORCH_CHECK(c >= 0 && c < a, "ring column out of range");
  const bool select = !drop.empty();
  TORCH_CHECK(!select || (static_cast<int64_t>(drop.size()) == n &&
                          static_cast<int64_t>(edges.size()) == n),
              "edges and drop must hold one value a row");
  TORCH_CHECK(shift >= 0 && shift <= 60, "shift out of range");
  const at::Tensor m = mass.contiguous();
  float* rp = ring.data_ptr<float>();
  float* tp = total.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const int64_t* cp = cols.data();
  const int64_t r0 = ring.stride(0), r1 = ring.stride(1), r2 = ring.stride(2), r3 = ring.stride(3);
  const int64_t t0 = total.stride(0), t1 = total.stride(1), t2 = total.stride(2), t3 = total.stride(3);
  const double up = std::ldexp(1.0, static_cast<int>(shift));
  const float down = std::ldexp(1.0f, -static_cast<int>(shift));
  std::vector<std::vector<int64_t>> near(select ? n : 0);  // per row, its candidates
  team::parallel_for(0, n, 4, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> sum(w);
    std::vector<float> totals(select ? w : 0), vals;
    for (int64_t i = lo; i < hi; ++i) {
      const bool sel = select && drop[i] > 0;
      const RingRow row{rp + (i / r) * r0 + row_of(i) * r1, tp + (i / r) * t0 + row_of(i) * t1,
                        mp + i * k * w, cp + i * k, pr.row(i), sel ? totals.data() : nullptr};
      if (r2 == 1 && t2 == 1)  // stored by columns, as the tables keep them: vectorised
#ifdef WINDOW_RING_LANES8
        ring_row8(row, sum.data(), w, k, r3, t3, up, down);
#else
        ring_row(row, sum.data(), w, k, 1, r3, 1, t3, up, down);
#endif
      else
        ring_row(row, sum.data(), w, k, r2, r3, t2, t3, up, down);
      if (sel) near_lowest(totals.data(), pr.row(i), w, edges[i], drop[i], rel, abs, near[i], vals);
    }
  });
  if (!select) return at::empty({0, w}, positions.options().dtype(at::kBool));
  at::Tensor out = team::zeros({n, w}, positions.options().dtype(at::kBool));
  bool* op = out.data_ptr<bool>();
  // A row with no more candidates than drops drops them all, whatever their sums' last
  // bits: only rows with more candidates than drops need the rings summed. In decode at
  // the budget that is rare (one candidate for one drop), and each candidate's ring is α
  // cold cache lines in the column layout: gathering them was half of a cold call.
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(near[i].size()) > drop[i]) {
      count += near[i].size();
      continue;
    }
    for (const int64_t s : near[i]) op[i * w + s] = true;
  }
  if (count == 0) return out;
  at::Tensor values = at::empty({count, a}, mass.options());  // the candidates' rings
  float* vp = values.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<int64_t>(near[i].size()) > drop[i])
      for (const int64_t s : near[i]) {
        const float* x = rp + (i / r) * r0 + row_of(i) * r1 + s * r2;
        for (int64_t c = 0; c < a; ++c) *vp++ = x[c * r3];
      }
  const at::Tensor sums = values.sum(1);  // torch's order: the torch form's bits
  const float* sp = sums.data_ptr<float>();
  std::vector<int64_t> idx;
  for (int64_t i = 0, off = 0; i < n; ++i)
    if (static_cast<int64_t>(near[i].size()) > drop[i]) {
      drop_among(near[i].data(), sp + off, near[i].size(), drop[i], op + i * w, idx);
      off += near[i].size();
    }
  return out;
}

// The new tokens' scores of knorm (-mean over the kv heads of ‖k‖; value_norm absent) and
// PagedEviction's token mode (mean over the heads of ‖v‖ / max(‖k‖, 1e-12)) written into
// their slots of a state, in one pass (policies/rows.py::RowsView.set_new_norm_score,
// whose torch form is the policy's score then `set_new`): the torch form's bits for up
// to four heads, where torch sums an inner dim's values in order and then divides by
// their count (a true division, as here: no reciprocal, no reassociation without
// -ffast-math). state [L, R, W] float32 (any strides); index [3, N, k] int64 (layer,
// request, slot of each new token, `RowsView.new_index`); key_norm, value_norm [N, k, H].
void new_scores(at::Tensor state, const at::Tensor& index, const at::Tensor& key_norm,
                const std::optional<at::Tensor>& value_norm) {
  TORCH_CHECK(state.dim() == 3 && state.scalar_type() == at::kFloat, "state must be [L, R, W] float32");
  TORCH_CHECK(index.dim() == 3 && index.size(0) == 3 && index.scalar_type() == at::kLong,
              "index must be [3, N, k] int64");
  const int64_t n = index.size(1), k = index.size(2), m = n * k;
  TORCH_CHECK(key_norm.dim() == 3 && key_norm.size(0) == n && key_norm.size(1) == k &&
              key_norm.scalar_type() == at::kFloat, "key_norm must be [N, k, H] float32");
  const int64_t h = key_norm.size(2);
  TORCH_CHECK(h >= 1 && h <= 4, "up to 4 heads (torch sums more in another order)");
  const bool paged = value_norm.has_value() && value_norm->defined();
  TORCH_CHECK(!paged || (value_norm->sizes() == key_norm.sizes() &&
                         value_norm->scalar_type() == at::kFloat),
              "value_norm must be shaped as key_norm, float32");
  const at::Tensor ix = index.contiguous(), kn = key_norm.contiguous();
  const at::Tensor vn = paged ? value_norm->contiguous() : at::Tensor();
  const int64_t* ip = ix.data_ptr<int64_t>();
  const float* kp = kn.data_ptr<float>();
  const float* vp = paged ? vn.data_ptr<float>() : nullptr;
  float* sp = state.data_ptr<float>();
  const float count = static_cast<float>(h);
  for (int64_t t = 0; t < m; ++t) {
    const int64_t l = ip[t], r = ip[m + t], slot = ip[2 * m + t];
    TORCH_CHECK(l >= 0 && l < state.size(0) && r >= 0 && r < state.size(1) && slot >= 0 &&
                slot < state.size(2), "new token index out of range");
    const float* kt = kp + t * h;
    float sum;
    if (paged) {
      const float* vt = vp + t * h;
      const auto ratio = [&](int64_t j) { return vt[j] / (kt[j] < 1e-12f ? 1e-12f : kt[j]); };
      sum = ratio(0);
      for (int64_t j = 1; j < h; ++j) sum += ratio(j);
    } else {
      sum = kt[0];
      for (int64_t j = 1; j < h; ++j) sum += kt[j];
    }
    const float mean = sum / count;
    sp[l * state.stride(0) + r * state.stride(1) + slot * state.stride(2)] = paged ? mean : -mean;
  }
}

// Each row's sum, at least 1e-30 ([N, W] float32 -> [N]): `head_parts`' denominator
// (TOVA's and LazyEviction's head mean), torch's sum with its bits. torch sums more than
// 32,768 elements (at::internal::GRAIN_SIZE) on its OpenMP threads, which a server's
// wait leaves asleep (engine/cpu_threads.py): a futex wake-up (40-70 us on this repo's
// VM) in every decode step of those policies for a sum of a few microseconds. Here torch
// sums chunks of whole rows under that size, each on this thread; a row is summed whole
// either way (torch splits a reduction of several outputs over them), so the bits are
// the same. Rows wider than the grain, or a single thread (nothing to wake), are summed
// in one call, as torch would.
at::Tensor row_sums(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [N, W] float32");
  const int64_t n = x.size(0), w = std::max<int64_t>(x.size(1), 1);
  at::Tensor out = at::empty({n}, x.options());
  const int64_t fit = (at::internal::GRAIN_SIZE - 1) / w;  // whole rows under the grain
  const int64_t step = fit > 0 && at::get_num_threads() > 1 ? fit : std::max<int64_t>(n, 1);
  for (int64_t a = 0; a < n; a += step) {
    const int64_t m = std::min(step, n - a);
    at::Tensor part = out.narrow(0, a, m);
    at::sum_out(part, x.narrow(0, a, m), {1});
  }
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) op[i] = std::max(op[i], 1e-30f);  // clamp_min: NaN stays
  return out;
}

TORCH_LIBRARY(kvserve_policy_state, m) {
  m.def("pyramid_window(Tensor(a!) ring, Tensor(b!) total, Tensor mass, int[] cols, Tensor positions, "
        "int[] edges, int[] drop, int shift, float rel, float abs, int[] rows=[]) -> Tensor");
  m.def("lazy_track(Tensor(a!) ts, Tensor(b!) mri, Tensor mass, Tensor total, Tensor positions, "
        "int[] qpos, int[] prompt, float alpha) -> ()");
  m.def("lazy_importance(Tensor ts, Tensor mri, int[] rows, int[] t) -> Tensor");
  m.def("new_scores(Tensor(a!) state, Tensor index, Tensor key_norm, Tensor? value_norm) -> ()");
  m.def("row_sums(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_policy_state, CPU, m) {
  m.impl("pyramid_window", pyramid_window);
  m.impl("lazy_track", lazy_track);
  m.impl("lazy_importance", lazy_importance);
  m.impl("new_scores", new_scores);
  m.impl("row_sums", row_sums);
}
