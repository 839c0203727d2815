// Per-slot state updates of the decode-time policies, in place, one pass per row.
//
// Registered as torch.ops.kvserve_policy_state.*; scheduler/policy_rows.py builds it on
// first use beside the selection (select_cpu.cpp) and the policies keep a torch form
// without it. Why kernels: a decode step updates every live slot's state from one
// query, a dozen element-wise torch sweeps over [rows, slots] each (lazy_eviction), or
// a scatter into and a sum over 32 values per slot that the engine copied out of its
// tables and back (pyramid's window ring: 8 MB each way at 16 requests of ~1k tokens).
// Here the state is read and written where the tables keep it (the view hands it as a
// [L, R, W(, k)] slice), once per slot.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

void check_rows(const at::Tensor& state, int64_t n, int64_t w, const char* what) {
  TORCH_CHECK(state.dim() >= 3 && state.size(0) * state.size(1) == n && state.size(2) == w,
              what, " must be [L, R, W, ...] with L * R rows of W slots");
  TORCH_CHECK(state.scalar_type() == at::kFloat, what, " must be float32");
}

// Pyramid's window (policies/pyramid.py::_shift_window): write this step's window
// queries' mass into their ring columns, then, if `want`, each live slot's window
// score, the sum of its ring (accumulated in double, rounded once: the window's mass to
// float32's last bit), 0 on dead slots. ring: [L, R, W, a], each slot's a values
// contiguous (any strides over L and R: a slice of the tables); mass: [L·R, k, W];
// cols: [L·R, k] the ring column of each query (distinct per row).
at::Tensor window_ring(at::Tensor ring, const at::Tensor& mass, const at::Tensor& cols,
                       const at::Tensor& positions, bool want) {
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong,
              "positions must be [N, W] int64");
  const int64_t n = positions.size(0), w = positions.size(1);
  check_rows(ring, n, w, "ring");
  TORCH_CHECK(ring.dim() == 4 && ring.stride(3) == 1 && ring.stride(2) == ring.size(3),
              "ring must be [L, R, W, a] with each slot's a values contiguous");
  TORCH_CHECK(mass.dim() == 3 && mass.size(0) == n && mass.size(2) == w &&
              mass.scalar_type() == at::kFloat, "mass must be [N, k, W] float32");
  TORCH_CHECK(cols.dim() == 2 && cols.size(0) == n && cols.size(1) == mass.size(1) &&
              cols.scalar_type() == at::kLong, "cols must be [N, k] int64");
  const int64_t a = ring.size(3), k = mass.size(1), r = ring.size(1);
  const at::Tensor m = mass.contiguous(), c = cols.contiguous(), p = positions.contiguous();
  at::Tensor out = at::zeros({want ? n : 0, w}, mass.options());
  float* rp = ring.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const int64_t* cp = c.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = ring.stride(0), s1 = ring.stride(1);
  for (int64_t i = 0; i < n * k; ++i)
    TORCH_CHECK(cp[i] >= 0 && cp[i] < a, "ring column out of range");
  at::parallel_for(0, n, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* row = rp + (i / r) * s0 + (i % r) * s1;
      const float* mi = mp + i * k * w;
      const int64_t* ci = cp + i * k;
      const int64_t* pi = pp + i * w;
      for (int64_t s = 0; s < w; ++s) {
        float* slot = row + s * a;
        for (int64_t j = 0; j < k; ++j) slot[ci[j]] = mi[j * w + s];
        if (!want || pi[s] < 0) continue;
        double acc = 0.0;
        for (int64_t q = 0; q < a; ++q) acc += slot[q];
        op[i * w + s] = static_cast<float>(acc);
      }
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

}  // namespace

TORCH_LIBRARY(kvserve_policy_state, m) {
  m.def("window_ring(Tensor(a!) ring, Tensor mass, Tensor cols, Tensor positions, bool want) -> Tensor");
  m.def("lazy_track(Tensor(a!) ts, Tensor(b!) mri, Tensor mass, Tensor total, Tensor positions, "
        "Tensor qpos, Tensor prompt, float alpha) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_policy_state, CPU, m) {
  m.impl("window_ring", window_ring);
  m.impl("lazy_track", lazy_track);
}
