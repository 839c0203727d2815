// Per-slot state updates of the decode-time policies, in place, one pass per row.
//
// Registered as torch.ops.kvserve_policy_state.*; scheduler/policy_rows.py builds it on
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
#include <tuple>
#include <vector>

#include "live_slots.h"

#if defined(KVSERVE_LIVE16) && defined(__AVX512DQ__)  // live16: live_slots.h
#define KVSERVE_AVX512 1
#endif

namespace {

using live_slots::lowest;  // live_slots.h (select_cpu.cpp's too)
#ifdef KVSERVE_LIVE16
using live_slots::live16;
#endif

// Append (i, j) for every live slot j of [a, b) with double(s[j]) <= thr, in slot order;
// 16 slots a compare with AVX-512 (a hit is rare: the few near a row's lowest).
inline void live_at_most(const float* s, const int64_t* pos, int64_t a, int64_t b, double thr,
                         int64_t i, std::vector<int64_t>& rows, std::vector<int64_t>& slots) {
  int64_t j = a;
#ifdef KVSERVE_AVX512
  const __m512d t = _mm512_set1_pd(thr);
  for (; j + 16 <= b; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    const __mmask8 lo = _mm512_cmp_pd_mask(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), t, _CMP_LE_OQ);
    const __mmask8 hi = _mm512_cmp_pd_mask(
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), t, _CMP_LE_OQ);
    unsigned hit = live16(pos, j) & (lo | (static_cast<unsigned>(hi) << 8));
    for (; hit; hit &= hit - 1) {
      rows.push_back(i);
      slots.push_back(j + __builtin_ctz(hit));
    }
  }
#endif
  for (; j < b; ++j)
    if (pos[j] >= 0 && static_cast<double>(s[j]) <= thr) {
      rows.push_back(i);
      slots.push_back(j);
    }
}

void check_rows(const at::Tensor& state, int64_t n, int64_t w, const char* what) {
  TORCH_CHECK(state.dim() >= 3 && state.size(0) * state.size(1) == n && state.size(2) == w,
              what, " must be [L, R, W, ...] with L * R rows of W slots");
  TORCH_CHECK(state.scalar_type() == at::kFloat, what, " must be float32");
}

// Pyramid's window (policies/pyramid.py::_window_ring, whose torch form this is):
// write this step's window queries' mass into their ring columns and keep each slot's
// window total exact in fixed point, so a step touches the written column and the total
// instead of the whole ring. A query's mass m (>= 0) counts as round(m · 2^shift), an
// integer; the total is their sum in int64, kept as three float32 digits of 21 bits
// (exact in float32: the state is float32), and a column's old value leaves it as the
// same integer it entered as: the total is the window's whatever the history.
// ring: [L, R, W, a] and total [L, R, W, 3], any strides (slices of the tables: the
// ring stored by columns, so a column of a row is contiguous); mass [L·R, k, W]; cols
// [L·R, k] (distinct per row). Returns, if `want`, each live slot's total as float32
// (one rounding of the int64, then an exact power-of-two scale), 0 on dead slots.
constexpr int kDigit = 21;
constexpr int64_t kDigitMask = (int64_t{1} << kDigit) - 1;

struct RingRow {
  float* ring;  // slot s, column q at s * r2 + q * r3
  float* total;  // slot s, digit d at s * t2 + d * t3
  const float* mass;  // [k, W]
  const int64_t* cols;  // [k]
  const int64_t* pos;  // [W]
  float* out;  // [W] or null
};

inline int64_t fixed(float x, double up) { return std::llrint(static_cast<double>(x) * up); }

// One row of `window_ring`; inlined with unit strides for the tables' column layout.
inline __attribute__((always_inline)) void ring_row(
    const RingRow& row, int64_t* sum, int64_t w, int64_t k, int64_t r2, int64_t r3,
    int64_t t2, int64_t t3, double up, float down, int64_t mass_stride = -1) {
  const int64_t ms = mass_stride < 0 ? w : mass_stride;  // between a row's query rows
  const float* d0 = row.total;
  const float* d1 = row.total + t3;
  const float* d2 = row.total + 2 * t3;
  for (int64_t s = 0; s < w; ++s)
    sum[s] = static_cast<int64_t>(d0[s * t2]) + (static_cast<int64_t>(d1[s * t2]) << kDigit) +
             static_cast<int64_t>(d2[s * t2]) * (int64_t{1} << (2 * kDigit));
  for (int64_t j = 0; j < k; ++j) {
    float* col = row.ring + row.cols[j] * r3;
    const float* mj = row.mass + j * ms;
    for (int64_t s = 0; s < w; ++s) {
      sum[s] += fixed(mj[s], up) - fixed(col[s * r2], up);
      col[s * r2] = mj[s];
    }
  }
  if (k) {
    float* e0 = row.total;
    float* e1 = row.total + t3;
    float* e2 = row.total + 2 * t3;
    for (int64_t s = 0; s < w; ++s) {
      e0[s * t2] = static_cast<float>(sum[s] & kDigitMask);
      e1[s * t2] = static_cast<float>((sum[s] >> kDigit) & kDigitMask);
      e2[s * t2] = static_cast<float>(sum[s] >> (2 * kDigit));
    }
  }
  if (row.out != nullptr)
    for (int64_t s = 0; s < w; ++s) {  // both sides computed: a select, not a branch
      const float v = static_cast<float>(sum[s]) * down;
      row.out[s] = row.pos[s] >= 0 ? v : 0.0f;
    }
}

#ifdef KVSERVE_AVX512
// `ring_row` for the tables' column layout (unit slot strides), 8 slots at a time: the
// same integer arithmetic, so the same bits (each conversion rounds as its scalar twin:
// float -> double exactly, llrint and int64 -> float to nearest even, the digits are
// integers). Scalar, the two llrint calls a slot (a double rounding each) and the int64
// sum through three float digits were ~5 ns a slot, most of pyramid's step.
inline void ring_row_avx512(const RingRow& row, int64_t* sum, int64_t w, int64_t k, int64_t r3,
                            int64_t t3, double up, float down) {
  float* d0 = row.total;
  float* d1 = row.total + t3;
  float* d2 = row.total + 2 * t3;
  const __m512d upv = _mm512_set1_pd(up);
  const __m512i digit = _mm512_set1_epi64(kDigitMask);
  const __m256 downv = _mm256_set1_ps(down);
  int64_t s = 0;
  for (; s + 8 <= w; s += 8) {
    __m512i v = _mm512_add_epi64(
        _mm512_cvttps_epi64(_mm256_loadu_ps(d0 + s)),
        _mm512_slli_epi64(_mm512_cvttps_epi64(_mm256_loadu_ps(d1 + s)), kDigit));
    v = _mm512_add_epi64(v, _mm512_slli_epi64(_mm512_cvttps_epi64(_mm256_loadu_ps(d2 + s)),
                                              2 * kDigit));
    for (int64_t j = 0; j < k; ++j) {
      float* col = row.ring + row.cols[j] * r3 + s;
      const __m256 m = _mm256_loadu_ps(row.mass + j * w + s);
      const __m512i fm = _mm512_cvtpd_epi64(_mm512_mul_pd(_mm512_cvtps_pd(m), upv));
      const __m512i fc = _mm512_cvtpd_epi64(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(col)), upv));
      v = _mm512_add_epi64(v, _mm512_sub_epi64(fm, fc));
      _mm256_storeu_ps(col, m);
    }
    if (k) {
      _mm256_storeu_ps(d0 + s, _mm512_cvtepi64_ps(_mm512_and_si512(v, digit)));
      _mm256_storeu_ps(d1 + s, _mm512_cvtepi64_ps(_mm512_and_si512(_mm512_srai_epi64(v, kDigit), digit)));
      _mm256_storeu_ps(d2 + s, _mm512_cvtepi64_ps(_mm512_srai_epi64(v, 2 * kDigit)));
    }
    if (row.out != nullptr) {
      const __mmask8 live = _mm512_cmpge_epi64_mask(_mm512_loadu_si512(row.pos + s), _mm512_setzero_si512());
      _mm256_storeu_ps(row.out + s, _mm256_maskz_mul_ps(live, _mm512_cvtepi64_ps(v), downv));
    }
  }
  if (s < w) {  // the last slots, as ring_row does them
    const RingRow tail{row.ring + s, row.total + s, row.mass + s, row.cols, row.pos + s,
                       row.out == nullptr ? nullptr : row.out + s};
    ring_row(tail, sum, w - s, k, 1, r3, 1, t3, up, down, w);
  }
}
#endif

at::Tensor window_ring(at::Tensor ring, at::Tensor total, const at::Tensor& mass,
                       const at::Tensor& cols, const at::Tensor& positions, bool want,
                       int64_t shift) {
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong,
              "positions must be [N, W] int64");
  const int64_t n = positions.size(0), w = positions.size(1);
  check_rows(ring, n, w, "ring");
  check_rows(total, n, w, "total");
  TORCH_CHECK(ring.dim() == 4 && total.dim() == 4 && total.size(3) == 3 &&
              total.size(1) == ring.size(1), "ring must be [L, R, W, a], total [L, R, W, 3]");
  TORCH_CHECK(mass.dim() == 3 && mass.size(0) == n && mass.size(2) == w &&
              mass.scalar_type() == at::kFloat, "mass must be [N, k, W] float32");
  TORCH_CHECK(cols.dim() == 2 && cols.size(0) == n && cols.size(1) == mass.size(1) &&
              cols.scalar_type() == at::kLong, "cols must be [N, k] int64");
  TORCH_CHECK(shift >= 0 && shift <= 60, "shift out of range");
  const int64_t a = ring.size(3), k = mass.size(1), r = ring.size(1);
  const at::Tensor m = mass.contiguous(), c = cols.contiguous(), p = positions.contiguous();
  at::Tensor out = at::zeros({want ? n : 0, w}, mass.options());
  float* rp = ring.data_ptr<float>();
  float* tp = total.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const int64_t* cp = c.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t r0 = ring.stride(0), r1 = ring.stride(1), r2 = ring.stride(2), r3 = ring.stride(3);
  const int64_t t0 = total.stride(0), t1 = total.stride(1), t2 = total.stride(2), t3 = total.stride(3);
  const double up = std::ldexp(1.0, static_cast<int>(shift));
  const float down = std::ldexp(1.0f, -static_cast<int>(shift));
  for (int64_t i = 0; i < n * k; ++i)
    TORCH_CHECK(cp[i] >= 0 && cp[i] < a, "ring column out of range");
  at::parallel_for(0, n, 4, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> sum(w);
    for (int64_t i = lo; i < hi; ++i) {
      const RingRow row{rp + (i / r) * r0 + (i % r) * r1, tp + (i / r) * t0 + (i % r) * t1,
                        mp + i * k * w, cp + i * k, pp + i * w, want ? op + i * w : nullptr};
      if (r2 == 1 && t2 == 1)  // stored by columns, as the tables keep them: vectorised
#ifdef KVSERVE_AVX512
        ring_row_avx512(row, sum.data(), w, k, r3, t3, up, down);
#else
        ring_row(row, sum.data(), w, k, 1, r3, 1, t3, up, down);
#endif
      else
        ring_row(row, sum.data(), w, k, r2, r3, t2, t3, up, down);
    }
  });
  return out;
}

// LazyEviction's Recurrence Interval Tracking for one query per row (a decode step;
// policies/lazy_eviction.py::_tracked, whose torch form this is): a slot is activated
// when mass / total >= alpha (float32, as `head_mean` divides), it is live and not
// after the query; then MRI = max(MRI, t - TS), TS = max(TS, t). A NaN TS (not seen
// yet) becomes the slot's birth time first. ts, mri: [L, R, W] float32 (any strides
// over L and R), updated in place; mass [N, W]; total, qpos, prompt [N].
void lazy_track(at::Tensor ts, at::Tensor mri, const at::Tensor& mass, const at::Tensor& total,
                const at::Tensor& positions, const at::Tensor& qpos, const at::Tensor& prompt,
                double alpha) {
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong,
              "positions must be [N, W] int64");
  const int64_t n = positions.size(0), w = positions.size(1);
  check_rows(ts, n, w, "ts");
  check_rows(mri, n, w, "mri");
  TORCH_CHECK(ts.dim() == 3 && mri.dim() == 3 && ts.stride(2) == 1 && mri.stride(2) == 1 &&
              ts.size(1) == mri.size(1), "ts and mri must be [L, R, W] with slots contiguous");
  TORCH_CHECK(mass.sizes() == positions.sizes() && mass.scalar_type() == at::kFloat,
              "mass must be [N, W] float32");
  TORCH_CHECK(total.dim() == 1 && total.size(0) == n && total.scalar_type() == at::kFloat,
              "total must be [N] float32");
  for (const at::Tensor* t : {&qpos, &prompt})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kLong,
                "qpos and prompt must be [N] int64");
  const at::Tensor m = mass.contiguous(), tot = total.contiguous(), p = positions.contiguous();
  const at::Tensor q = qpos.contiguous(), pr = prompt.contiguous();
  const int64_t r = ts.size(1);
  float *tp = ts.data_ptr<float>(), *mp = mri.data_ptr<float>();
  const float* ap = m.data_ptr<float>();
  const float* sp = tot.data_ptr<float>();
  const int64_t *pp = p.data_ptr<int64_t>(), *qp = q.data_ptr<int64_t>(), *rp = pr.data_ptr<int64_t>();
  const float a32 = static_cast<float>(alpha);  // torch compares a float32 tensor in float32
  at::parallel_for(0, n, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* tsr = tp + (i / r) * ts.stride(0) + (i % r) * ts.stride(1);
      float* mr = mp + (i / r) * mri.stride(0) + (i % r) * mri.stride(1);
      const float* ai = ap + i * w;
      const int64_t* pi = pp + i * w;
      const float den = sp[i];
      const int64_t qi = qp[i], pl = rp[i];
      const double t = static_cast<double>(qi - pl + 1);
      for (int64_t s = 0; s < w; ++s) {
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

// Pyramid's selection reads the window's float32 sum as torch sums it (the ring's α
// values in torch's order), which can differ from the exact total in its last bits and
// so break near ties differently. Only candidates near each row's d-th lowest can be
// dropped: this marks, per row, the candidates (live slots outside the first `first` and
// last `last` live ones) whose exact total is at most the d-th lowest candidate's times
// (1 + rel) plus `abs` (rel and abs bound the float32 sum's error and the total's
// rounding, policies/pyramid.py::_near_lowest); the caller sums those exactly as torch
// does and ranks every other candidate above them.
std::tuple<at::Tensor, at::Tensor> near_lowest(const at::Tensor& scores, const at::Tensor& positions,
                                               const at::Tensor& first, const at::Tensor& last,
                                               const at::Tensor& drop, double rel, double abs) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat, "scores must be [N, W] float32");
  TORCH_CHECK(positions.sizes() == scores.sizes() && positions.scalar_type() == at::kLong,
              "positions must be [N, W] int64 like scores");
  const int64_t n = scores.size(0), w = scores.size(1);
  for (const at::Tensor* t : {&first, &last, &drop})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kLong,
                "first, last and drop must be [N] int64");
  const at::Tensor sc = scores.contiguous(), p = positions.contiguous();
  const at::Tensor f = first.contiguous(), l = last.contiguous(), d = drop.contiguous();
  const float* sp = sc.data_ptr<float>();
  const int64_t* pp = p.data_ptr<int64_t>();
  const int64_t *fp = f.data_ptr<int64_t>(), *lp = l.data_ptr<int64_t>(), *dp = d.data_ptr<int64_t>();
  std::vector<int64_t> rows, slots;  // in row order, one thread (a few per row)
  {
    std::vector<float> vals;
    for (int64_t i = 0; i < n; ++i) {
      if (dp[i] <= 0) continue;
      const int64_t* pos = pp + i * w;
      const float* s = sp + i * w;
      int64_t a = 0, b = w;  // the candidates' span, as select_cpu.cpp's select_row
      for (int64_t k = 0; a < w && k < fp[i]; ++a) k += pos[a] >= 0;
      for (int64_t k = 0; b > a && k < lp[i]; --b) k += pos[b - 1] >= 0;
      float kth = INFINITY;  // the d-th lowest candidate total
      if (dp[i] == 1) {  // decode at the budget: the lowest, one vectorised pass
        kth = lowest(s, pos, a, b);
        if (kth == INFINITY) continue;
      } else {
        vals.clear();
        for (int64_t j = a; j < b; ++j)
          if (pos[j] >= 0) vals.push_back(s[j]);
        if (vals.empty()) continue;
        const int64_t k = std::min<int64_t>(dp[i], vals.size()) - 1;
        std::nth_element(vals.begin(), vals.begin() + k, vals.end());
        kth = vals[k];
      }
      live_at_most(s, pos, a, b, static_cast<double>(kth) * (1.0 + rel) + abs, i, rows, slots);
    }
  }
  const int64_t m = rows.size();
  at::Tensor r = at::empty({m}, positions.options()), c = at::empty({m}, positions.options());
  std::memcpy(r.data_ptr<int64_t>(), rows.data(), m * sizeof(int64_t));
  std::memcpy(c.data_ptr<int64_t>(), slots.data(), m * sizeof(int64_t));
  return {r, c};
}

// The drop mask [N, W] of the drop[i] lowest `values` among row i's entries (rows,
// slots: `near_lowest`'s lists, in row then slot order), ties toward the later slot:
// the selection `drop_lowest` makes over a whole row, here over the only entries of it
// that can be dropped.
at::Tensor drop_among(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& values,
                      const at::Tensor& drop, int64_t w) {
  TORCH_CHECK(rows.dim() == 1 && slots.sizes() == rows.sizes() && values.sizes() == rows.sizes() &&
              rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
              values.scalar_type() == at::kFloat, "rows, slots [M] int64 and values [M] float32");
  TORCH_CHECK(drop.dim() == 1 && drop.scalar_type() == at::kLong, "drop must be [N] int64");
  const int64_t n = drop.size(0), m = rows.size(0);
  const at::Tensor rr = rows.contiguous(), ss = slots.contiguous(), vv = values.contiguous();
  const at::Tensor dd = drop.contiguous();
  const int64_t *rp = rr.data_ptr<int64_t>(), *sp = ss.data_ptr<int64_t>(), *dp = dd.data_ptr<int64_t>();
  const float* vp = vv.data_ptr<float>();
  at::Tensor out = at::zeros({n, w}, drop.options().dtype(at::kBool));
  bool* op = out.data_ptr<bool>();
  std::vector<int64_t> idx;
  for (int64_t a = 0; a < m;) {
    int64_t b = a;
    while (b < m && rp[b] == rp[a]) ++b;
    const int64_t i = rp[a];
    TORCH_CHECK(i >= 0 && i < n, "row out of range");
    idx.resize(b - a);
    for (int64_t k = a; k < b; ++k) idx[k - a] = k;
    // ascending value, a NaN above every number, ties: the later slot first
    std::sort(idx.begin(), idx.end(), [&](int64_t x, int64_t y) {
      const bool nx = std::isnan(vp[x]), ny = std::isnan(vp[y]);
      if (nx != ny) return !nx;
      if (!nx && vp[x] != vp[y]) return vp[x] < vp[y];
      return sp[x] > sp[y];
    });
    const int64_t d = std::min<int64_t>(std::max<int64_t>(dp[i], 0), b - a);
    for (int64_t k = 0; k < d; ++k) {
      TORCH_CHECK(sp[idx[k]] >= 0 && sp[idx[k]] < w, "slot out of range");
      op[i * w + sp[idx[k]]] = true;
    }
    a = b;
  }
  return out;
}

}  // namespace

// ring[rows // r, rows % r, slots] ([M, α], contiguous): the rings of the few slots
// `near_lowest` found, copied out of the tables' column layout in one pass (torch's
// advanced indexing with three index tensors, and the divisions making them, were most
// of `_drop_near`). ring [L, r, W, α] float32, any strides; rows, slots [M] int64.
at::Tensor ring_values(const at::Tensor& ring, const at::Tensor& rows, const at::Tensor& slots) {
  TORCH_CHECK(ring.dim() == 4 && ring.scalar_type() == at::kFloat, "ring must be [L, R, W, a] float32");
  TORCH_CHECK(rows.dim() == 1 && slots.sizes() == rows.sizes() && rows.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong, "rows and slots must be [M] int64");
  const int64_t m = rows.size(0), r = ring.size(1), w = ring.size(2), a = ring.size(3);
  const at::Tensor rw = rows.contiguous(), sl = slots.contiguous();
  const int64_t *rp = rw.data_ptr<int64_t>(), *sp = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < ring.size(0) * r && sp[i] >= 0 && sp[i] < w,
                "row or slot out of range");
  at::Tensor out = at::empty({m, a}, ring.options());
  const float* src = ring.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t s0 = ring.stride(0), s1 = ring.stride(1), s2 = ring.stride(2), s3 = ring.stride(3);
  for (int64_t i = 0; i < m; ++i) {
    const float* x = src + (rp[i] / r) * s0 + (rp[i] % r) * s1 + sp[i] * s2;
    for (int64_t c = 0; c < a; ++c) dst[i * a + c] = x[c * s3];
  }
  return out;
}

TORCH_LIBRARY(kvserve_policy_state, m) {
  m.def("window_ring(Tensor(a!) ring, Tensor(b!) total, Tensor mass, Tensor cols, Tensor positions, "
        "bool want, int shift) -> Tensor");
  m.def("near_lowest(Tensor scores, Tensor positions, Tensor first, Tensor last, Tensor drop, "
        "float rel, float abs) -> (Tensor, Tensor)");
  m.def("drop_among(Tensor rows, Tensor slots, Tensor values, Tensor drop, int w) -> Tensor");
  m.def("ring_values(Tensor ring, Tensor rows, Tensor slots) -> Tensor");
  m.def("lazy_track(Tensor(a!) ts, Tensor(b!) mri, Tensor mass, Tensor total, Tensor positions, "
        "Tensor qpos, Tensor prompt, float alpha) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_policy_state, CPU, m) {
  m.impl("window_ring", window_ring);
  m.impl("lazy_track", lazy_track);
  m.impl("near_lowest", near_lowest);
  m.impl("drop_among", drop_among);
  m.impl("ring_values", ring_values);
}
