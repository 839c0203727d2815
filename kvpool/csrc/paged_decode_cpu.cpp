// Paged decode attention for CPU: one query per sequence, keys and values read from
// the pool's blocks where they lie (no gather into a padded copy).
//
// Registered as torch.ops.kvserve.paged_decode; kvpool/cpu_attention.py builds it on
// first use and documents the contract. Same visibility rule as kvpool/attention.py:
// a slot is seen when its position is >= 0, <= the query's and inside the window.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

// fp32 rows are used where they lie; 16-bit rows are widened once into `buf`.
template <typename T>
inline const float* row(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// One job per sequence, all heads together: a slot's K (then V) row for every head is
// one contiguous read, and the visible-slot list is built once. DC is the head dim when
// known at compile time (0: read it at run time): fixed trip counts let the compiler
// keep a head's dot product and output row in vector registers.
template <typename T, int64_t DC>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& table, const at::Tensor& slot_pos, const at::Tensor& q_pos,
            double scale, int64_t window, at::Tensor& out, float* mass) {
  const int64_t B = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t NB = table.size(1), S = NB * bs, row_len = Hkv * D;
  const T* qd = q.data_ptr<T>();
  const T* kd = k_cache.data_ptr<T>();
  const T* vd = v_cache.data_ptr<T>();
  const int64_t* td = table.data_ptr<int64_t>();
  const int64_t* pd = slot_pos.data_ptr<int64_t>();
  const int64_t* qpd = q_pos.data_ptr<int64_t>();
  T* od = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), buf(row_len), acc(Hq * D), score;
    std::vector<int64_t> logical, phys;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t qp = qpd[b];
      logical.clear();
      phys.clear();
      for (int64_t j = 0; j < NB; ++j) {
        const int64_t blk = td[b * NB + j];
        if (blk < 0) continue;
        for (int64_t o = 0; o < bs; ++o) {
          const int64_t p = pd[b * S + j * bs + o];
          if (p < 0 || p > qp || (window > 0 && p <= qp - window)) continue;
          logical.push_back(j * bs + o);
          phys.push_back(blk * bs + o);
        }
      }
      const int64_t n = static_cast<int64_t>(phys.size());
      T* orow = od + b * Hq * D;
      if (n == 0) {
        std::fill(orow, orow + Hq * D, static_cast<T>(0));
        continue;
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const T* src = qd + b * qs0 + hq * qs1;
        for (int64_t x = 0; x < D; ++x) qf[hq * D + x] = static_cast<float>(src[x]) * fscale;
      }
      score.resize(Hq * n);
      for (int64_t i = 0; i < n; ++i) {
        const float* k = row(kd + phys[i] * row_len, buf.data(), row_len);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* kh = k + (hq / G) * D;
          const float* qh = qf.data() + hq * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t x = 0; x < D; ++x) s += qh[x] * kh[x];
          score[hq * n + i] = s;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {  // softmax per query head
        float* sh = score.data() + hq * n;
        const float m = *std::max_element(sh, sh + n);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sh[i] = std::exp(sh[i] - m);
          sum += sh[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float* v = row(vd + phys[i] * row_len, buf.data(), row_len);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float p = score[hq * n + i];
          const float* vh = v + (hq / G) * D;
          float* ah = acc.data() + hq * D;
#pragma omp simd
          for (int64_t x = 0; x < D; ++x) ah[x] += p * vh[x];
        }
      }
      for (int64_t x = 0; x < Hq * D; ++x) orow[x] = static_cast<T>(acc[x]);
      if (mass != nullptr) {  // probability per slot summed over each kv group's heads
        for (int64_t h = 0; h < Hkv; ++h) {
          float* mrow = mass + (b * Hkv + h) * S;
          for (int64_t i = 0; i < n; ++i) {
            float s = 0.f;
            for (int64_t g = 0; g < G; ++g) s += score[(h * G + g) * n + i];
            mrow[logical[i]] = s;
          }
        }
      }
    }
  });
}

std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& table,
                                     const at::Tensor& slot_pos, const at::Tensor& q_pos,
                                     double scale, int64_t window, bool return_probs) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with unit last stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(table.scalar_type() == at::kLong && slot_pos.scalar_type() == at::kLong &&
                  q_pos.scalar_type() == at::kLong, "table, slot_pos and q_pos must be int64");
  const at::Tensor t = table.contiguous(), p = slot_pos.contiguous(), qp = q_pos.contiguous();
  TORCH_CHECK(p.size(0) == q.size(0) && p.size(1) == t.size(1) * k_cache.size(1) &&
                  qp.numel() == q.size(0), "slot_pos must be [B, NB*bs] and q_pos [B]");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor mass = return_probs
      ? at::zeros({q.size(0), k_cache.size(2), p.size(1)}, q.options().dtype(at::kFloat))
      : at::empty({0}, q.options().dtype(at::kFloat));
  float* mp = return_probs ? mass.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    switch (q.size(2)) {
      case 32: decode<scalar_t, 32>(q, k_cache, v_cache, t, p, qp, scale, window, out, mp); break;
      case 64: decode<scalar_t, 64>(q, k_cache, v_cache, t, p, qp, scale, window, out, mp); break;
      case 128: decode<scalar_t, 128>(q, k_cache, v_cache, t, p, qp, scale, window, out, mp); break;
      default: decode<scalar_t, 0>(q, k_cache, v_cache, t, p, qp, scale, window, out, mp);
    }
  });
  return {out, mass};
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor slot_pos, "
        "Tensor q_pos, float scale, int window, bool return_probs) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode", &paged_decode); }
