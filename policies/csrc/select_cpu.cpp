// The policies' one selection on CPU: per row of slots, drop the d lowest-scoring
// candidates, a candidate being a live slot (position >= 0) outside the row's first
// `first` and last `last` live slots (attention sinks, the recent window).
//
// Registered as torch.ops.kvserve_policies.select_drop; kvpool/policy_rows.py builds
// it on first use and policies/rows.py::drop_lowest falls back to torch ops without it.
// Why a kernel: the torch form is a dozen passes over [rows, slots] (mask, top-k,
// threshold, tie count from the end, recent-window cumsum), each a memory-bound sweep;
// at 64 rows of a thousand slots they were most of a scoring policy's step. Here each
// row is read once (rows in parallel): decode drops a token or a few per row, kept in a
// small sorted buffer; a large drop (a prompt's plan) uses nth_element.
//
// Order: score ascending, a NaN above every number, ties toward the later slot, which
// is exactly what policies/rows.py::drop_lowest's stable sort gives.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "adaptive.h"  // AdaKV's drop counts, registered below
#include "live_slots.h"
#include "../../native/csrc/team.h"

namespace {

struct Key {
  float v;
  bool nan;
  int64_t slot;
};

// a is dropped before b
inline bool before(const Key& a, const Key& b) {
  if (a.nan != b.nan) return !a.nan;
  if (!a.nan && a.v != b.v) return a.v < b.v;
  return a.slot > b.slot;
}

constexpr int64_t kSmall = 16;

using live_slots::alive;
using live_slots::lowest;
#ifdef KVSERVE_LIVE16
using live_slots::live16;
#elif defined(KVSERVE_LIVE8)
using live_slots::live8;
#endif

// The latest slot in [a, b) that is live and holds `lo` (-1 if none): 16 slots at a
// time from the end (AVX-512; 8 with AVX2), stopping at the first block with a hit. The scalar
// search read half a row on average, a compare and a branch per slot.
template <typename P>
inline int64_t last_equal(const float* s, const P* pos, int64_t a, int64_t b, float lo) {
  int64_t j = b;
#ifdef KVSERVE_LIVE16  // AVX-512 F, BW and VL (live_slots.h)
  const __m512 want = _mm512_set1_ps(lo);
  for (; j - 16 >= a; j -= 16) {
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(live16(pos, j - 16), _mm512_loadu_ps(s + j - 16),
                                                  want, _CMP_EQ_OQ);
    if (hit) return j - 16 + (31 - __builtin_clz(static_cast<unsigned>(hit)));
  }
#elif defined(KVSERVE_LIVE8)  // 8 at a time (AVX2)
  const __m256 want = _mm256_set1_ps(lo);
  for (; j - 8 >= a; j -= 8) {
    const int hit = _mm256_movemask_ps(_mm256_and_ps(
        live8(pos, j - 8), _mm256_cmp_ps(_mm256_loadu_ps(s + j - 8), want, _CMP_EQ_OQ)));
    if (hit) return j - 8 + (31 - __builtin_clz(static_cast<unsigned>(hit)));
  }
#endif
  for (--j; j >= a; --j)
    if (alive(pos, j) && s[j] == lo) return j;
  return -1;
}

template <typename P>
void select_row(const float* s, const P* pos, int64_t w, int64_t first, int64_t last,
                int64_t d, bool* out) {
  if (d <= 0) return;
  const auto [a, b] = live_slots::candidates(pos, w, first, last);
  if (b <= a) return;
  std::vector<Key> buf;
  if (d == 1) {  // decode at the budget: the lowest score, then its latest slot
    // Two vector passes (`lowest`, then `last_equal` from the end,
    // which stops at the first block with a hit). A NaN never compares, so it is taken
    // only when no candidate is below +inf: then the scalar search from the end below
    // (the latest +inf, else the latest NaN, as `before` orders them).
    const float lo = lowest(s, pos, a, b);
    int64_t at = -1, nan_at = -1;
    if (lo < INFINITY) {  // a minimum below +inf: its latest live slot
      at = last_equal(s, pos, a, b, lo);
      if (at >= 0) out[at] = true;
      return;
    }
    for (int64_t j = b - 1; j >= a && at < 0; --j) {
      if (!alive(pos, j)) continue;
      if (s[j] == lo) at = j;
      else if (nan_at < 0 && std::isnan(s[j])) nan_at = j;
    }
    if (at < 0) at = nan_at;
    if (at >= 0) out[at] = true;
    return;
  }
  if (d <= kSmall) {
    buf.reserve(d + 1);
    for (int64_t j = a; j < b; ++j) {
      if (!alive(pos, j)) continue;
      const Key k{s[j], std::isnan(s[j]), j};
      if ((int64_t)buf.size() == d && !before(k, buf.back())) continue;
      buf.insert(std::upper_bound(buf.begin(), buf.end(), k, before), k);
      if ((int64_t)buf.size() > d) buf.pop_back();
    }
  } else {
    buf.reserve(b - a);
    for (int64_t j = a; j < b; ++j)
      if (alive(pos, j)) buf.push_back(Key{s[j], std::isnan(s[j]), j});
    d = std::min<int64_t>(d, buf.size());
    if (d == 0) return;
    std::nth_element(buf.begin(), buf.begin() + (d - 1), buf.end(), before);
    buf.resize(d);
  }
  for (const Key& k : buf) out[k.slot] = true;
}

using live_slots::Rows;
using live_slots::rows_of;

// Scores as [N, W] rows, or [L, R, W] (a policy's per-slot state as the tables' own
// slice, `RowsView.layered`), read in place: N rows of the positions' W slots.
Rows<float> score_rows(const at::Tensor& scores, int64_t n, int64_t w) {
  Rows<float> sr = rows_of<float>(scores, "scores");
  TORCH_CHECK(sr.n == n && sr.w == w, "scores must hold N = L·R rows of positions' W slots");
  return sr;
}

// scores and positions [N, W] or [L, R, W] (`Rows`); positions int64, or a bool live
// mask [N, W]. counts [3, N] int64: each row's first, last and drop (one host-made
// tensor: three would be three more ops to slice it, each cold after the forward).
// `divisor` [N] float32: row i ranks scores / divisor[i] (each quotient
// one IEEE division, as torch divides), which can tie values its scores do not: TOVA's
// head mean (`head_mean`) without its own pass over the rows.
at::Tensor select_drop(const at::Tensor& scores, const at::Tensor& positions,
                       const at::Tensor& counts, const std::optional<at::Tensor>& divisor) {
  const bool mask = positions.scalar_type() == at::kBool;
  const int64_t n = positions.dim() == 3 ? positions.size(0) * positions.size(1) : positions.size(0);
  const int64_t w = positions.size(-1);
  const Rows<float> sr = score_rows(scores, n, w);
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == 3 && counts.size(1) == n &&
                  counts.scalar_type() == at::kLong,
              "counts must be [3, N] int64 (first, last, drop)");
  at::Tensor dv;
  if (divisor.has_value()) {
    dv = divisor->contiguous();
    TORCH_CHECK(dv.dim() == 1 && dv.size(0) == n && dv.scalar_type() == at::kFloat,
                "divisor must be [N] float32");
  }
  const float* dvp = dv.defined() ? dv.data_ptr<float>() : nullptr;
  const at::Tensor c = counts.contiguous();
  at::Tensor out = team::zeros({n, w}, positions.options().dtype(at::kBool));
  const int64_t *fp = c.data_ptr<int64_t>(), *lp = fp + n, *dp = fp + 2 * n;
  bool* op = out.data_ptr<bool>();
  const auto run = [&](const auto& pr) {
    team::parallel_for(0, n, 8, [&](int64_t a, int64_t b) {
      std::vector<float> q(dvp != nullptr ? w : 0);  // a row's quotients
      for (int64_t i = a; i < b; ++i) {
        const float* s = sr.row(i);
        if (dvp != nullptr && dp[i] > 0) {
          const float by = dvp[i];
          for (int64_t j = 0; j < w; ++j) q[j] = s[j] / by;
          s = q.data();
        }
        select_row(s, pr.row(i), w, fp[i], lp[i], dp[i], op + i * w);
      }
    });
  };
  if (mask) run(rows_of<bool>(positions, "a live mask"));
  else run(rows_of<int64_t>(positions, "positions"));
  return out;
}

// Per row, the drop[i] live slots that follow its first first[i] live ones (the
// streaming family's middle): a walk from the row's start that stops at its last drop,
// where the torch form sweeps every row whole with a cumsum and three compares.
at::Tensor drop_earliest(const at::Tensor& positions, const at::Tensor& first, const at::Tensor& drop) {
  const Rows<int64_t> pr = rows_of<int64_t>(positions, "positions");
  const int64_t n = pr.n, w = pr.w;
  for (const at::Tensor* t : {&first, &drop})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kLong,
                "first and drop must be [N] int64");
  const at::Tensor f = first.contiguous(), d = drop.contiguous();
  at::Tensor out = team::zeros({n, w}, positions.options().dtype(at::kBool));
  const int64_t *fp = f.data_ptr<int64_t>(), *dp = d.data_ptr<int64_t>();
  bool* op = out.data_ptr<bool>();
  team::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t* row = pr.row(i);
      int64_t skip = fp[i], left = dp[i];
      for (int64_t j = 0; j < w && left > 0; ++j) {
        if (row[j] < 0) continue;
        if (skip > 0) { --skip; continue; }
        op[i * w + j] = true;
        --left;
      }
    }
  });
  return out;
}

}  // namespace

// PagedEviction's block mode (policies/paged_eviction.py::_block_drops, whose torch form
// these two are): in two passes over the rows that drop a block instead of a dozen torch
// ops (a packed check, flips, a selection, a gather, a mask scattered back over every
// row), each paying its cold code after the forward. The block means between them stay
// torch's (`mean` over each block's bs packed values), so they are the same bits.
//
// Scores rows[i] of [N, W] or [L, R, W] (as select_drop takes them) with each row's live
// slots (positions >= 0) first, in slot order, then zeros: [M, P], P = W rounded up to
// bs. Logical block j of a row is its live slots of kept-order rank j·bs .. j·bs + bs - 1.
at::Tensor pack_live(const at::Tensor& scores, const at::Tensor& positions, const at::Tensor& rows,
                     int64_t bs) {
  const Rows<int64_t> pr = rows_of<int64_t>(positions, "positions");
  const int64_t n = pr.n, w = pr.w;
  const Rows<float> sr = score_rows(scores, n, w);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && bs > 0, "rows must be [M] int64");
  const at::Tensor rw = rows.contiguous();
  const int64_t m = rows.size(0), width = (w + bs - 1) / bs * bs;
  at::Tensor out = team::zeros({m, width}, scores.options());
  const int64_t* rp = rw.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = rp[i];
    TORCH_CHECK(r >= 0 && r < n, "row out of range");
    const float* src = sr.row(r);
    const int64_t* pos = pr.row(r);
    float* dst = op + i * width;
    int64_t k = 0;
    for (int64_t j = 0; j < w; ++j)
      if (pos[j] >= 0) dst[k++] = src[j];
  }
  return out;
}

// The drop mask [N, W] of rows[i]'s drop[i] lowest-mean candidate blocks (blocks
// j < nfull[i] of `means` [M, nb]; ties toward the earlier block, a NaN above every
// number): the live slots of those blocks' ranks. Other rows drop nothing.
at::Tensor block_drops(const at::Tensor& means, const at::Tensor& positions, const at::Tensor& rows,
                       const at::Tensor& nfull, const at::Tensor& drop, int64_t bs) {
  const Rows<int64_t> pr = rows_of<int64_t>(positions, "positions");
  const int64_t n = pr.n, w = pr.w, m = rows.size(0);
  TORCH_CHECK(means.dim() == 2 && means.size(0) == m && means.scalar_type() == at::kFloat,
              "means must be [M, nb] float32");
  for (const at::Tensor* t : {&rows, &nfull, &drop})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == m && t->scalar_type() == at::kLong,
                "rows, nfull and drop must be [M] int64");
  const int64_t nb = means.size(1);
  const at::Tensor mn = means.contiguous();
  const at::Tensor rw = rows.contiguous(), nf = nfull.contiguous(), dr = drop.contiguous();
  const float* mp = mn.data_ptr<float>();
  const int64_t* rp = rw.data_ptr<int64_t>();
  const int64_t *fp = nf.data_ptr<int64_t>(), *dp = dr.data_ptr<int64_t>();
  at::Tensor out = team::zeros({n, w}, positions.options().dtype(at::kBool));
  bool* op = out.data_ptr<bool>();
  std::vector<int64_t> cand;
  std::vector<char> gone(nb);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = rp[i], c = std::min(fp[i], nb), d = std::min(dp[i], c);
    TORCH_CHECK(r >= 0 && r < n, "row out of range");
    if (d <= 0) continue;
    const float* mean = mp + i * nb;
    cand.resize(c);
    for (int64_t j = 0; j < c; ++j) cand[j] = j;
    const auto lower = [&](int64_t a, int64_t b) {  // mean ascending (NaN last), then index
      const bool na = std::isnan(mean[a]), nb_ = std::isnan(mean[b]);
      if (na != nb_) return nb_;
      if (!na && mean[a] != mean[b]) return mean[a] < mean[b];
      return a < b;
    };
    std::partial_sort(cand.begin(), cand.begin() + d, cand.end(), lower);
    std::fill(gone.begin(), gone.end(), 0);
    for (int64_t j = 0; j < d; ++j) gone[cand[j]] = 1;
    const int64_t* pos = pr.row(r);
    bool* row = op + r * w;
    for (int64_t j = 0, rank = 0; j < w; ++j)
      if (pos[j] >= 0) {
        row[j] = gone[std::min(rank / bs, nb - 1)];
        ++rank;
      }
  }
  return out;
}

TORCH_LIBRARY(kvserve_policies, m) {
  m.def("select_drop(Tensor scores, Tensor positions, Tensor counts, Tensor? divisor=None) -> Tensor");
  m.def("drop_earliest(Tensor positions, Tensor first, Tensor drop) -> Tensor");
  m.def("pack_live(Tensor scores, Tensor positions, Tensor rows, int bs) -> Tensor");
  m.def("block_drops(Tensor means, Tensor positions, Tensor rows, Tensor nfull, Tensor drop, "
        "int bs) -> Tensor");
  m.def("adaptive_drops(Tensor scores, Tensor live, Tensor counts, int heads, int requests, "
        "Tensor? divisor=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_policies, CPU, m) {
  m.impl("select_drop", select_drop);
  m.impl("drop_earliest", drop_earliest);
  m.impl("pack_live", pack_live);
  m.impl("block_drops", block_drops);
  m.impl("adaptive_drops", adaptive::adaptive_drops);
}
