// Carrying out a plan's drops in the shared slot tables on CPU, in one pass.
//
// Registered as torch.ops.kvserve_tables.mark_dead; kvpool/tables.py::SlotTables.evict_mask
// calls it and keeps its torch form as the fallback (no compiler, another device).
// Why a kernel: the torch form is about ten memory-bound sweeps over [layers, rows, slots]
// (read the rows' positions, mask the live drops, count them, write -1, write the rows
// back, find the emptied blocks, compare layers), at 64 rows of a thousand slots most of
// a cheap policy's step. Here each (layer, row) reads the drop mask once and touches the
// positions only where a slot dies and in the blocks that lost one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

namespace {

// slot_pos [L, Rt, S] int64, updated in place; rows [R] the caches' rows; dead [L, R, W]
// bool (W <= S, a multiple of bs); alike [R] bool (caches whose layers hold the same
// slots). Returns (counts [L, R] int64: slots that died; emptied [R] bool: a block of the
// row lost its last live slot; same [R] bool: every layer lost the same slots, computed
// for alike rows only).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mark_dead(at::Tensor slot_pos, const at::Tensor& rows,
                                                         const at::Tensor& dead, const at::Tensor& alike,
                                                         int64_t bs) {
  TORCH_CHECK(slot_pos.dim() == 3 && slot_pos.scalar_type() == at::kLong && slot_pos.is_contiguous(),
              "slot_pos must be a contiguous [L, Rt, S] int64 tensor");
  TORCH_CHECK(dead.dim() == 3 && dead.scalar_type() == at::kBool, "dead must be [L, R, W] bool");
  const int64_t nl = dead.size(0), r = dead.size(1), w = dead.size(2);
  const int64_t rt = slot_pos.size(1), s = slot_pos.size(2);
  TORCH_CHECK(slot_pos.size(0) == nl && w <= s && bs > 0 && w % bs == 0, "dead does not fit slot_pos");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == r && rows.scalar_type() == at::kLong, "rows must be [R] int64");
  TORCH_CHECK(alike.dim() == 1 && alike.size(0) == r && alike.scalar_type() == at::kBool, "alike must be [R] bool");
  const at::Tensor d = dead.contiguous(), rw = rows.contiguous(), al = alike.contiguous();
  at::Tensor counts = at::zeros({nl, r}, rows.options());
  at::Tensor emptied = at::zeros({r}, alike.options());
  at::Tensor same = at::ones({r}, alike.options());
  int64_t* sp = slot_pos.data_ptr<int64_t>();
  const bool* dp = d.data_ptr<bool>();
  const int64_t* rp = rw.data_ptr<int64_t>();
  const bool* ap = al.data_ptr<bool>();
  int64_t* cp = counts.data_ptr<int64_t>();
  bool* ep = emptied.data_ptr<bool>();
  bool* mp = same.data_ptr<bool>();
  for (int64_t i = 0; i < r; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < rt, "row out of range");
  at::parallel_for(0, r, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t row = rp[i];
      if (ap[i]) {  // before any write: did every layer lose the same live slots?
        const int64_t* p0 = sp + row * s;
        const bool* d0 = dp + i * w;
        for (int64_t l = 1; l < nl && mp[i]; ++l) {
          const int64_t* pl = sp + (l * rt + row) * s;
          const bool* dl = dp + (l * r + i) * w;
          for (int64_t j = 0; j < w; ++j)
            if ((dl[j] && pl[j] >= 0) != (d0[j] && p0[j] >= 0)) { mp[i] = false; break; }
        }
      }
      for (int64_t l = 0; l < nl; ++l) {
        int64_t* p = sp + (l * rt + row) * s;
        const bool* dl = dp + (l * r + i) * w;
        int64_t n = 0;
        for (int64_t blk = 0; blk < w; blk += bs) {
          bool some = false;  // an OR over the block's flags (vectorised): most have none
          for (int64_t j = blk; j < blk + bs; ++j) some |= dl[j];
          if (!some) continue;
          bool hit = false;
          for (int64_t j = blk; j < blk + bs; ++j)
            if (dl[j] && p[j] >= 0) { p[j] = -1; ++n; hit = true; }
          if (hit && !ep[i]) {
            bool any = false;
            for (int64_t j = blk; j < blk + bs && !any; ++j) any = p[j] >= 0;
            if (!any) ep[i] = true;
          }
        }
        cp[l * r + i] = n;
      }
    }
  });
  return {counts, emptied, same};
}

}  // namespace

TORCH_LIBRARY(kvserve_tables, m) {
  m.def("mark_dead(Tensor(a!) slot_pos, Tensor rows, Tensor dead, Tensor alike, int bs) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve_tables, CPU, m) { m.impl("mark_dead", mark_dead); }
