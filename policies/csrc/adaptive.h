// AdaKV's drop counts (policies/heads.py::adaptive_drops, whose torch form this is): per
// (layer, request) group of a per-head view's rows, how many tokens each kv head drops so
// that the group drops its heads' total over budget at its lowest scores, each head's top
// `safe` candidates kept whatever the others score. Included by select_cpu.cpp (one
// library, registered there as torch.ops.kvserve_policies.adaptive_drops).
//
// Why a pass of its own: the torch form is two top-k or sort passes over [rows, slots]
// and a dozen masks, cumsums and compares around them, each a sweep of every row; here a
// group's rows are read once. A decode step's group drops a token or a few: a row whose
// top cannot reach its `total` lowest values hands on just those (a small sorted buffer),
// so no selection runs over its candidates; otherwise two nth_elements do.
//
// Only counts come out, so only values matter, never which of equal values a selection
// took: a head's top takes its `safe` highest candidate values (a NaN above every number),
// the group's drops its `total` lowest remaining (-inf first, taking their ranks but not
// dropped; +inf and NaN after every finite value), equal values to the lower head first.
// One exception the sort form's order decides: a head whose `safe` exceeds its candidates
// above -inf takes the rest from its slots holding -inf in slot order, where every
// non-candidate slot (dead, sink, window) also counts as -inf; so a -inf candidate after
// enough non-candidates stays in the group's pool, walked here slot by slot.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "live_slots.h"
#include "../../native/csrc/team.h"

namespace adaptive {

using live_slots::alive;
using live_slots::Rows;
using live_slots::rows_of;

// a before b in the safeguard's order: a NaN above every number, then descending
inline bool higher(float a, float b) {
  const bool an = std::isnan(a), bn = std::isnan(b);
  if (an != bn) return an;
  return !an && a > b;
}

struct Scratch {
  std::vector<float> cand, finite, sel;
};

// One row's share of its group's pool: appends to `t.finite` at least its `total` lowest
// finite pool values (all of its pool's finite values where the safeguard needs a
// selection), and returns its count of -inf pool entries. `by`: divide the scores by it
// (each quotient one IEEE division, as torch divides), or not.
template <typename P>
int64_t row_pool(const float* s, const P* pos, int64_t w, int64_t first, int64_t last,
                 int64_t floor, int64_t total, const float* by, Scratch& t) {
  const auto [a, b] = live_slots::candidates(pos, w, first, last);  // live slots in [a, b)
  int64_t live = 0, neg_inf = 0, hi = 0;  // hi: candidates above -inf (a NaN included)
  for (int64_t j = 0; j < w; ++j) live += alive(pos, j);
  // decode drops a token or a few a group: keep only the row's `total` lowest finite
  // values, in a small sorted buffer, while counting the rest
  const bool small = total <= 16;
  t.cand.clear();
  for (int64_t j = a; j < b; ++j) {
    if (!alive(pos, j)) continue;
    const float v = by != nullptr ? s[j] / *by : s[j];
    if (v == -INFINITY) { ++neg_inf; continue; }
    ++hi;
    if (!small) t.cand.push_back(v);
    else if (std::isfinite(v) && (t.cand.size() < static_cast<size_t>(total) || v < t.cand.back())) {
      t.cand.insert(std::upper_bound(t.cand.begin(), t.cand.end(), v), v);
      if (t.cand.size() > static_cast<size_t>(total)) t.cand.pop_back();
    }
  }
  const int64_t safe = std::max<int64_t>(0, floor - (live - hi - neg_inf));  // sinks, window count
  if (safe < hi && hi - safe >= total && small) {
    // the row's `total` lowest are past its top, so they are its pool's lowest
    t.finite.insert(t.finite.end(), t.cand.begin(), t.cand.end());
    return neg_inf;
  }
  int64_t pool_inf = neg_inf;
  if (safe >= hi) {
    // every candidate above -inf is in the top; the rest of it, the first `safe - hi`
    // slots at -inf in slot order (non-candidates included)
    int64_t left = safe - hi;
    for (int64_t j = 0; j < w && left > 0; ++j) {
      if (!(j >= a && j < b && alive(pos, j))) {
        --left;
      } else if ((by != nullptr ? s[j] / *by : s[j]) == -INFINITY) {
        --left;
        --pool_inf;
      }
    }
    return pool_inf;
  }
  if (small) {  // the top reaches them: every candidate value, then the selection
    t.cand.clear();
    for (int64_t j = a; j < b; ++j) {
      if (!alive(pos, j)) continue;
      const float v = by != nullptr ? s[j] / *by : s[j];
      if (v != -INFINITY) t.cand.push_back(v);
    }
  }
  if (safe > 0)
    std::nth_element(t.cand.begin(), t.cand.begin() + safe, t.cand.end(), higher);
  for (int64_t j = safe; j < hi; ++j)
    if (std::isfinite(t.cand[j])) t.finite.push_back(t.cand[j]);
  return pool_inf;
}

// scores [N, W] or [L, R, W] float32; live [N, W] (bool, or int64 positions); counts
// [4, N] int64: each row's first, last, over (live before the plan less its budget) and
// floor (int(budget × ALPHA)); rows (l·H + h)·R + r; divisor [N] float32 or none.
// Returns [N] int64, each row's drop count.
template <typename P>
at::Tensor drops(const Rows<float>& sr, const Rows<P>& pr, const at::Tensor& counts, int64_t heads,
                 int64_t requests, const float* dv) {
  const int64_t n = pr.n, w = pr.w;
  TORCH_CHECK(sr.n == n && sr.w == w, "scores must hold the live mask's N rows of W slots");
  TORCH_CHECK(heads > 0 && requests > 0 && n % (heads * requests) == 0,
              "rows must be layers × heads × requests");
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == 4 && counts.size(1) == n &&
                  counts.scalar_type() == at::kLong,
              "counts must be [4, N] int64 (first, last, over, floor)");
  const at::Tensor c = counts.contiguous();
  const int64_t *fp = c.data_ptr<int64_t>(), *lp = fp + n, *op = fp + 2 * n, *kp = fp + 3 * n;
  at::Tensor out = team::zeros({n}, counts.options());
  int64_t* res = out.data_ptr<int64_t>();
  const int64_t groups = n / heads;  // (layer, request) pairs
  team::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    Scratch t;
    std::vector<int64_t> seg(heads + 1), rows(heads);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t layer = g / requests, r = g % requests;
      int64_t total = 0;
      for (int64_t h = 0; h < heads; ++h) {
        rows[h] = (layer * heads + h) * requests + r;
        total += op[rows[h]];
      }
      if (total <= 0) continue;
      t.finite.clear();
      int64_t left = total;  // what remains after the -inf pool entries take their ranks
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t i = rows[h];
        seg[h] = static_cast<int64_t>(t.finite.size());
        left -= row_pool(sr.row(i), pr.row(i), w, fp[i], lp[i], kp[i], total,
                         dv != nullptr ? dv + i : nullptr, t);
      }
      seg[heads] = static_cast<int64_t>(t.finite.size());
      const int64_t m = seg[heads];
      if (left <= 0) continue;
      if (left >= m) {  // every finite pool value goes (no row's share was cut short)
        for (int64_t h = 0; h < heads; ++h) res[rows[h]] = seg[h + 1] - seg[h];
        continue;
      }
      t.sel.assign(t.finite.begin(), t.finite.end());
      std::nth_element(t.sel.begin(), t.sel.begin() + (left - 1), t.sel.end());
      const float kth = t.sel[left - 1];
      int64_t room = left;
      for (int64_t j = 0; j < m; ++j) room -= t.finite[j] < kth;
      // ties at the threshold to the lower head first; a row's share cut at `total`
      // holds at least as many of them as the room left when its turn comes
      for (int64_t h = 0; h < heads; ++h) {
        int64_t below = 0, tied = 0;
        for (int64_t j = seg[h]; j < seg[h + 1]; ++j) {
          below += t.finite[j] < kth;
          tied += t.finite[j] == kth;
        }
        const int64_t take = std::min(tied, room);
        room -= take;
        res[rows[h]] = below + take;
      }
    }
  });
  return out;
}

inline at::Tensor adaptive_drops(const at::Tensor& scores, const at::Tensor& live,
                                 const at::Tensor& counts, int64_t heads, int64_t requests,
                                 const std::optional<at::Tensor>& divisor) {
  const Rows<float> sr = rows_of<float>(scores, "scores");
  at::Tensor dvt;
  if (divisor.has_value()) {
    dvt = divisor->contiguous();
    TORCH_CHECK(dvt.dim() == 1 && dvt.size(0) == sr.n && dvt.scalar_type() == at::kFloat,
                "divisor must be [N] float32");
  }
  const float* dv = dvt.defined() ? dvt.data_ptr<float>() : nullptr;
  if (live.scalar_type() == at::kBool)
    return drops(sr, rows_of<bool>(live, "a live mask"), counts, heads, requests, dv);
  return drops(sr, rows_of<int64_t>(live, "positions"), counts, heads, requests, dv);
}

}  // namespace adaptive
