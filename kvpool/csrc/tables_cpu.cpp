// The host-side passes of the shared slot tables and the pool on CPU, each one op where
// the torch form is several dispatches a step: carrying out a plan's drops (mark_dead,
// free_dead, compact_rows), the decode append (append_rows), reference counts
// (release_refs). kvpool/tables.py and kvpool/pool.py call them and keep their torch forms as the fallback (no compiler, another device).
//
// mark_dead, why a kernel: the torch form is about ten memory-bound sweeps over [layers, rows, slots]
// (read the rows' positions, mask the live drops, count them, write -1, write the rows
// back, find the emptied blocks, compare layers), at 64 rows of a thousand slots most of
// a cheap policy's step. Here each (layer, row) reads the drop mask once and touches the
// positions only where a slot dies and in the blocks that lost one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../../native/csrc/team.h"

namespace {

// Whether any of n bools is set, read 8 bytes at a time (a bool is 0 or 1): a plan's
// mask has a flag in a few blocks of a row, and a byte loop over every block was most
// of `mark_dead` (~1 ns a byte).
inline bool any_flag(const bool* f, int64_t n) {
  uint64_t acc = 0;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t x;
    std::memcpy(&x, f + j, 8);
    acc |= x;
  }
  for (; j < n; ++j) acc |= static_cast<uint64_t>(f[j]);
  return acc != 0;
}

// Each row's sizes [Rt, 3, L] int64 (blocks held, slots appended, live slots per layer:
// kvpool/tables.py's SlotTables.sizes), read and updated in place by the passes below.
void check_sizes(const at::Tensor& sizes, int64_t rt, int64_t nl) {
  TORCH_CHECK(sizes.dim() == 3 && sizes.scalar_type() == at::kLong && sizes.is_contiguous() &&
              sizes.size(0) >= rt && sizes.size(1) == 3 && sizes.size(2) == nl,
              "sizes must be a contiguous [Rt, 3, L] int64 tensor");
}

// Each row's ring ([Rt, 3 + L] int64: kvpool/tables.py's SlotTables.ring): its sinks, its
// cap (0: no ring), its overwritten slots not yet counted, and per layer the logical slot
// the next overwrite takes.
void check_ring(const at::Tensor& ring, int64_t rt, int64_t nl) {
  TORCH_CHECK(ring.dim() == 2 && ring.scalar_type() == at::kLong && ring.is_contiguous() &&
              ring.size(0) >= rt && ring.size(1) == 3 + nl,
              "ring must be a contiguous [Rt, 3 + L] int64 tensor");
}

// Whether layer l of a row writes its next decode token over its oldest token past the
// sinks instead of appending (StreamingLLM's evict-before-write, SlotTables.start_ring):
// the row has a ring and the layer holds exactly `cap` slots, every one live. `g` is the
// row's ring, `z` its sizes.
inline bool ring_writes(const int64_t* g, const int64_t* z, int64_t nl, int64_t l) {
  const int64_t cap = g[1];
  return cap > 0 && z[nl + l] == cap && z[2 * nl + l] == cap;
}

// slot_pos [L, Rt, S] int64, updated in place; sizes: each row's live counts lose the
// slots that died; rows [R] the caches' rows; dead [L, R, W] bool (W <= S, a multiple of
// bs); alike [R] bool (caches whose layers hold the same slots). Returns (counts [L, R]
// int64: slots that died; emptied [R] bool: a block of the row lost its last live slot;
// same [R] bool: every layer lost the same slots, computed for alike rows only).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mark_dead(at::Tensor slot_pos, at::Tensor sizes,
                                                         const at::Tensor& rows, const at::Tensor& dead,
                                                         const at::Tensor& alike, int64_t bs) {
  TORCH_CHECK(slot_pos.dim() == 3 && slot_pos.scalar_type() == at::kLong && slot_pos.is_contiguous(),
              "slot_pos must be a contiguous [L, Rt, S] int64 tensor");
  TORCH_CHECK(dead.dim() == 3 && dead.scalar_type() == at::kBool, "dead must be [L, R, W] bool");
  const int64_t nl = dead.size(0), r = dead.size(1), w = dead.size(2);
  const int64_t rt = slot_pos.size(1), s = slot_pos.size(2);
  TORCH_CHECK(slot_pos.size(0) == nl && w <= s && bs > 0 && w % bs == 0, "dead does not fit slot_pos");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == r && rows.scalar_type() == at::kLong, "rows must be [R] int64");
  TORCH_CHECK(alike.dim() == 1 && alike.size(0) == r && alike.scalar_type() == at::kBool, "alike must be [R] bool");
  check_sizes(sizes, rt, nl);
  int64_t* zp = sizes.data_ptr<int64_t>();
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
  team::parallel_for(0, r, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t row = rp[i];
      if (ap[i]) {  // before any write: did every layer lose the same live slots?
        const int64_t* p0 = sp + row * s;
        const bool* d0 = dp + i * w;
        for (int64_t l = 1; l < nl && mp[i]; ++l) {
          const int64_t* pl = sp + (l * rt + row) * s;
          const bool* dl = dp + (l * r + i) * w;
          // Only the blocks where either layer has a flag can differ (a plan drops a few
          // slots of a thousand): a word-wise OR finds them.
          for (int64_t blk = 0; blk < w && mp[i]; blk += bs) {
            if (!any_flag(d0 + blk, bs) && !any_flag(dl + blk, bs)) continue;
            for (int64_t j = blk; j < blk + bs; ++j)
              if ((dl[j] && pl[j] >= 0) != (d0[j] && p0[j] >= 0)) { mp[i] = false; break; }
          }
        }
      }
      for (int64_t l = 0; l < nl; ++l) {
        int64_t* p = sp + (l * rt + row) * s;
        const bool* dl = dp + (l * r + i) * w;
        int64_t n = 0;
        for (int64_t blk = 0; blk < w; blk += bs) {
          if (!any_flag(dl + blk, bs)) continue;  // most blocks have no flag
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
        zp[(row * 3 + 2) * nl + l] -= n;
      }
    }
  });
  return {counts, emptied, same};
}

// A per-slot state as runs of slots: for (layer, row, run c) the slots' values start at
// base + ((layer · Rt + row) · runs + c) · S · bytes. A state [L, Rt, S, ...] is one run
// of `bytes` per slot; one stored by columns ([L, Rt, k, S]) is k runs of one value.
struct StateRuns {
  char* base;
  int64_t runs;
  int64_t bytes;
};

std::vector<StateRuns> state_runs(const std::vector<at::Tensor>& states, const at::Tensor& columns,
                                  int64_t nl, int64_t rt, int64_t s) {
  TORCH_CHECK(columns.dim() == 1 && columns.size(0) == static_cast<int64_t>(states.size()) &&
              columns.scalar_type() == at::kBool, "columns must be [states] bool");
  const at::Tensor by_cols = columns.contiguous();
  std::vector<StateRuns> out;
  for (size_t t = 0; t < states.size(); ++t) {
    const at::Tensor& x = states[t];
    const bool by_col = by_cols.data_ptr<bool>()[t];
    TORCH_CHECK(x.is_contiguous() && x.dim() >= 3 && x.size(0) == nl && x.size(1) == rt &&
                x.size(by_col ? 3 : 2) == s && (!by_col || x.dim() == 4),
                "a state must be a contiguous [L, Rt, Wt * bs, ...] or [L, Rt, k, Wt * bs] tensor");
    const int64_t runs = by_col ? x.size(2) : 1;
    out.push_back({static_cast<char*>(x.data_ptr()), runs,
                   x.numel() / (nl * rt * s * runs) * static_cast<int64_t>(x.element_size())});
  }
  return out;
}

// base[j] = old base[order[j]] for from <= j < n, items of `bytes` (through a buffer);
// order maps [from, n) onto itself (the items before `from` stay where they are).
void permute_slots(char* base, const int64_t* order, int64_t n, int64_t bytes, std::vector<char>& buf,
                   int64_t from = 0) {
  if (n <= from) return;
  buf.resize((n - from) * bytes);
  for (int64_t j = from; j < n; ++j)
    std::memcpy(buf.data() + (j - from) * bytes, base + order[j] * bytes, bytes);
  std::memcpy(base + from * bytes, buf.data(), (n - from) * bytes);
}

// The layered tables every pass below walks: table [L, Rt, Wt] and slot_pos
// [L, Rt, Wt * bs], both contiguous int64; returns L, Rt, Wt and Wt * bs.
std::array<int64_t, 4> check_tables(const at::Tensor& table, const at::Tensor& slot_pos, int64_t bs) {
  TORCH_CHECK(table.dim() == 3 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "table must be a contiguous [L, Rt, Wt] int64 tensor");
  const int64_t nl = table.size(0), rt = table.size(1), wt = table.size(2), s = wt * bs;
  TORCH_CHECK(slot_pos.dim() == 3 && slot_pos.scalar_type() == at::kLong && slot_pos.is_contiguous() &&
              slot_pos.size(0) == nl && slot_pos.size(1) == rt && slot_pos.size(2) == s,
              "slot_pos must be a contiguous [L, Rt, Wt * bs] int64 tensor");
  return {nl, rt, wt, s};
}

// Return the blocks of the caches' rows with no live slot to the pool and close the gaps
// (SlotTables.free_dead_blocks, whose torch form this is: about twenty sweeps over the
// rows' tables, positions and every per-slot state, most of a cheap policy's step on the
// steps a block empties). Per (layer, row) among `only` layers: block j < nb is alive if
// a slot holds a position, or it is the tail block (j = nb - 1) with room for appends
// (next < nb·bs); the alive blocks move to the front in order, then the dead ones, then
// the rest up to w (the torch form's stable argsort), positions and each state moving
// with their block; the table and positions past the kept blocks become -1. table
// [L, Rt, Wt], slot_pos [L, Rt, Wt·bs] and states [L, Rt, Wt·bs, ...] (contiguous; a
// state with `columns` set is given as its storage [L, Rt, k, Wt·bs], k runs of slots)
// are updated in place, and so are the rows' sizes (blocks held and slots appended lose
// the dead blocks; w is the most blocks any of the rows holds in any layer). Returns (the
// freed block ids in [L, R, w] order, the dead blocks per (layer, cache) [L, R]).
std::tuple<at::Tensor, at::Tensor> free_dead(at::Tensor table, at::Tensor slot_pos, at::Tensor sizes,
                                             std::vector<at::Tensor> states,
                                             const at::Tensor& columns, const at::Tensor& rows,
                                             const at::Tensor& only, int64_t bs) {
  const std::array<int64_t, 4> dims = check_tables(table, slot_pos, bs);
  const int64_t nl = dims[0], rt = dims[1], wt = dims[2], s = dims[3];
  const int64_t r = rows.size(0);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be [R] int64");
  TORCH_CHECK(only.dim() == 1 && only.size(0) == nl && only.scalar_type() == at::kBool, "only must be [L] bool");
  check_sizes(sizes, rt, nl);
  const std::vector<StateRuns> st = state_runs(states, columns, nl, rt, s);
  const at::Tensor rw = rows.contiguous(), on = only.contiguous();
  const int64_t* rp = rw.data_ptr<int64_t>();
  int64_t* zp = sizes.data_ptr<int64_t>();
  const bool* op = on.data_ptr<bool>();
  int64_t w = 0;
  for (int64_t i = 0; i < r; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < rt, "row out of range");
    for (int64_t l = 0; l < nl; ++l) {
      const int64_t nb = zp[rp[i] * 3 * nl + l];
      TORCH_CHECK(nb >= 0 && nb <= wt, "nblocks out of range");
      w = std::max(w, nb);
    }
  }
  at::Tensor counts = at::zeros({nl, r}, rows.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  int64_t* tp = table.data_ptr<int64_t>();
  int64_t* sp = slot_pos.data_ptr<int64_t>();
  std::vector<int64_t> freed, order;
  std::vector<char> buf;
  for (int64_t l = 0; l < nl; ++l) {
    if (!op[l]) continue;
    for (int64_t i = 0; i < r; ++i) {
      const int64_t row = rp[i];
      int64_t* z = zp + row * 3 * nl;
      const int64_t nb = z[l], nxt = z[nl + l];
      int64_t* tbl = tp + (l * rt + row) * wt;
      int64_t* pos = sp + (l * rt + row) * s;
      order.clear();
      int64_t ndead = 0;
      for (int64_t j = 0; j < nb; ++j) {
        bool alive = j == nb - 1 && nxt < nb * bs;
        for (int64_t k = j * bs; k < (j + 1) * bs && !alive; ++k) alive = pos[k] >= 0;
        if (alive) order.push_back(j);
        else ++ndead;
      }
      if (ndead == 0) continue;
      const int64_t kept = nb - ndead;
      for (int64_t j = 0; j < nb; ++j) {  // the dead blocks, in order, after the kept ones
        bool alive = j == nb - 1 && nxt < nb * bs;
        for (int64_t k = j * bs; k < (j + 1) * bs && !alive; ++k) alive = pos[k] >= 0;
        if (!alive) { order.push_back(j); freed.push_back(tbl[j]); }
      }
      for (int64_t j = nb; j < w; ++j) order.push_back(j);
      cp[l * r + i] = ndead;
      z[l] -= ndead;
      z[nl + l] -= ndead * bs;
      // Move whole blocks of every per-slot array by `order`, then clear what lies past
      // the kept blocks. Only [d0, nb) moves (d0 the first dead block: the blocks before
      // it and from nb on map onto themselves), not the whole width.
      int64_t d0 = 0;
      while (d0 < nb && order[d0] == d0) ++d0;
      permute_slots(reinterpret_cast<char*>(tbl), order.data(), nb, sizeof(int64_t), buf, d0);
      permute_slots(reinterpret_cast<char*>(pos), order.data(), nb, bs * sizeof(int64_t), buf, d0);
      for (int64_t j = kept; j < w; ++j) tbl[j] = -1;
      for (int64_t k = kept * bs; k < w * bs; ++k) pos[k] = -1;
      for (const StateRuns& x : st)
        for (int64_t c = 0; c < x.runs; ++c)
          permute_slots(x.base + ((l * rt + row) * x.runs + c) * s * x.bytes, order.data(), nb,
                        bs * x.bytes, buf, d0);
    }
  }
  at::Tensor ids = at::empty({static_cast<int64_t>(freed.size())}, rows.options());
  std::memcpy(ids.data_ptr<int64_t>(), freed.data(), freed.size() * sizeof(int64_t));
  return {ids, counts};
}

// `mark_dead`, then `free_dead` over every layer of the rows in which a block lost its
// last live slot: SlotTables.evict_mask's native form, one dispatch and one small result
// where the two passes and the Python between them (the counts as lists, the emptied
// rows, a second rows tensor, the freed counts summed) were ~50 us of a policy step.
// Returns (info [R, 3 + L] int64: per cache the slots that died over all layers, the
// blocks freed, 1 if every layer lost the same slots (computed for alike rows, else 1),
// then the slots that died in each layer; the freed block ids, as free_dead orders them).
std::tuple<at::Tensor, at::Tensor> evict_rows(at::Tensor table, at::Tensor slot_pos, at::Tensor sizes,
                                              std::vector<at::Tensor> states,
                                              const at::Tensor& columns, const at::Tensor& rows,
                                              const at::Tensor& dead, const at::Tensor& alike,
                                              int64_t bs) {
  const auto [counts, emptied, same] = mark_dead(slot_pos, sizes, rows, dead, alike, bs);
  const int64_t nl = counts.size(0), r = counts.size(1);
  const int64_t ni = 3 + nl;  // info's columns
  at::Tensor info = at::zeros({r, ni}, rows.options());
  int64_t* ip = info.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  const bool* ep = emptied.data_ptr<bool>();
  const bool* mp = same.data_ptr<bool>();
  const at::Tensor rw = rows.contiguous();
  const int64_t* rp = rw.data_ptr<int64_t>();
  std::vector<int64_t> hit, hit_rows;
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t l = 0; l < nl; ++l) {
      ip[i * ni] += cp[l * r + i];
      ip[i * ni + 3 + l] = cp[l * r + i];
    }
    ip[i * ni + 2] = mp[i];
    if (ep[i]) {
      hit.push_back(i);
      hit_rows.push_back(rp[i]);
    }
  }
  if (hit.empty()) return {info, at::empty({0}, rows.options())};
  const at::Tensor sub = at::tensor(hit_rows, rows.options());
  const at::Tensor all = at::ones({nl}, alike.options());
  const auto [ids, ndead] = free_dead(table, slot_pos, sizes, std::move(states), columns, sub, all, bs);
  const int64_t* dp = ndead.data_ptr<int64_t>();
  const int64_t m = static_cast<int64_t>(hit.size());
  for (int64_t k = 0; k < m; ++k)
    for (int64_t l = 0; l < nl; ++l) ip[hit[k] * ni + 1] += dp[l * m + k];
  return {info, ids};
}

// Pack every (cache, layer)'s live tokens, in order, into its first blocks
// (SlotTables.compact, whose torch form this is: a dozen sweeps over the rows' whole
// width, a sort, and a gather/scatter of every moved slot's K/V through index tensors;
// about 1.4 ms per call at 16 requests of ~1k tokens). Per (layer, row) of the `only`
// layers whose live count n differs from its next slot (a hole): the live slots move
// down in order, their K/V copied slot by slot in increasing order (a token only moves
// down and no later move reads a slot already written, so no buffer is needed); the
// positions and each state are permuted as the torch form's stable order (live first,
// then the dead, over the whole width), the positions past n become -1 and the blocks
// from ceil(n / bs) on are released. Nothing is changed and `declined` is returned when
// a destination block is shared (ref > 1): the caller's torch form copies it first.
// A packed (layer, row)'s sizes become its kept blocks and live count (appends resume
// after the live slots). flats: the pool's [2, slots, ...] tensors (K/V, scales).
// Returns (declined, released block ids, blocks released [L, R], live counts [L, R],
// holes [L, R]).
std::tuple<bool, at::Tensor, at::Tensor, at::Tensor, at::Tensor> compact_rows(
    at::Tensor table, at::Tensor slot_pos, at::Tensor sizes, std::vector<at::Tensor> states,
    const at::Tensor& columns, std::vector<at::Tensor> flats, const at::Tensor& rows,
    const at::Tensor& only, const at::Tensor& ref, int64_t bs) {
  const std::array<int64_t, 4> dims = check_tables(table, slot_pos, bs);
  const int64_t nl = dims[0], rt = dims[1], wt = dims[2], s = dims[3];
  const int64_t r = rows.size(0);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be [R] int64");
  check_sizes(sizes, rt, nl);
  int64_t* zp = sizes.data_ptr<int64_t>();
  TORCH_CHECK(only.dim() == 1 && only.size(0) == nl && only.scalar_type() == at::kBool, "only must be [L] bool");
  TORCH_CHECK(ref.dim() == 1 && ref.scalar_type() == at::kInt && ref.is_contiguous(), "ref must be [blocks] int32");
  const std::vector<StateRuns> st = state_runs(states, columns, nl, rt, s);
  std::vector<int64_t> flat_bytes;  // per flat: bytes of one slot
  for (const at::Tensor& f : flats) {
    TORCH_CHECK(f.is_contiguous() && f.dim() >= 2 && f.size(0) == 2 && f.size(1) == ref.size(0) * bs,
                "a pool tensor must be a contiguous [2, blocks * bs, ...] tensor");
    flat_bytes.push_back(f.numel() / (2 * f.size(1)) * f.element_size());
  }
  const at::Tensor rw = rows.contiguous(), on = only.contiguous();
  const int64_t* rp = rw.data_ptr<int64_t>();
  const bool* op = on.data_ptr<bool>();
  const int32_t* refp = ref.data_ptr<int32_t>();
  for (int64_t i = 0; i < r; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < rt, "row out of range");
  at::Tensor gone = at::zeros({nl, r}, rows.options());
  at::Tensor count = at::zeros({nl, r}, rows.options());
  at::Tensor hole = at::zeros({nl, r}, only.options());
  int64_t *gp = gone.data_ptr<int64_t>(), *np = count.data_ptr<int64_t>();
  bool* hp = hole.data_ptr<bool>();
  int64_t* tp = table.data_ptr<int64_t>();
  int64_t* sp = slot_pos.data_ptr<int64_t>();
  const int64_t nblocks_pool = ref.size(0);
  // Pass 1: live counts, holes, and whether every destination block is ours alone.
  for (int64_t l = 0; l < nl; ++l)
    for (int64_t i = 0; i < r; ++i) {
      const int64_t* pos = sp + (l * rt + rp[i]) * s;
      const int64_t* tbl = tp + (l * rt + rp[i]) * wt;
      int64_t n = 0, first = -1;
      for (int64_t j = 0; j < s; ++j) {
        if (pos[j] >= 0) ++n;
        else if (first < 0) first = j;
      }
      np[l * r + i] = n;
      if (!op[l] || n == zp[(rp[i] * 3 + 1) * nl + l]) continue;
      hp[l * r + i] = true;
      for (int64_t col = first / bs; first >= 0 && first < n && col <= (n - 1) / bs; ++col) {
        const int64_t b = tbl[col];
        if (b >= 0 && b < nblocks_pool && refp[b] > 1)
          return {true, at::empty({0}, rows.options()), gone, count, hole};
      }
    }
  // Pass 2: move.
  std::vector<int64_t> freed, order(s);
  std::vector<char> buf;
  for (int64_t l = 0; l < nl; ++l)
    for (int64_t i = 0; i < r; ++i) {
      if (!hp[l * r + i]) continue;
      const int64_t row = rp[i], n = np[l * r + i];
      int64_t* pos = sp + (l * rt + row) * s;
      int64_t* tbl = tp + (l * rt + row) * wt;
      int64_t k = 0;
      for (int64_t j = 0; j < s; ++j) if (pos[j] >= 0) order[k++] = j;
      for (int64_t j = 0; j < s; ++j) if (pos[j] < 0) order[k++] = j;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t src = order[j];
        if (src == j) continue;
        const int64_t from = tbl[src / bs] * bs + src % bs, to = tbl[j / bs] * bs + j % bs;
        for (size_t f = 0; f < flats.size(); ++f) {
          char* base = static_cast<char*>(flats[f].data_ptr());
          const int64_t half = flats[f].size(1) * flat_bytes[f], e = flat_bytes[f];
          std::memcpy(base + to * e, base + from * e, e);
          std::memcpy(base + half + to * e, base + half + from * e, e);
        }
      }
      permute_slots(reinterpret_cast<char*>(pos), order.data(), s, sizeof(int64_t), buf);
      for (int64_t j = n; j < s; ++j) pos[j] = -1;
      for (const StateRuns& x : st)
        for (int64_t c = 0; c < x.runs; ++c)
          permute_slots(x.base + ((l * rt + row) * x.runs + c) * s * x.bytes, order.data(), s,
                        x.bytes, buf);
      const int64_t keep_blocks = (n + bs - 1) / bs;
      for (int64_t col = keep_blocks; col < wt; ++col) {
        if (tbl[col] >= 0) {
          freed.push_back(tbl[col]);
          ++gp[l * r + i];
        }
        tbl[col] = -1;
      }
      zp[(row * 3) * nl + l] = keep_blocks;
      zp[(row * 3 + 1) * nl + l] = n;
    }
  at::Tensor ids = at::empty({static_cast<int64_t>(freed.size())}, rows.options());
  std::memcpy(ids.data_ptr<int64_t>(), freed.data(), freed.size() * sizeof(int64_t));
  return {false, ids, gone, count, hole};
}

// Every decoding cache's next slot in one pass (SlotTables.append_decode). The rows' sizes
// (sizes [Rt, 3, L] int64: blocks held, slots appended, live slots per layer) are read and
// bumped here, so the host lists only the rows: a per-request Python pass over the sizes
// was ~1.5 us a request, a tenth of a 3M model's 64-request step outside the forward. The
// torch form is about ten dispatches. `plan` is one host list of ints:
//   rows [b] | positions [b] | free block ids it may take [k]
// A layer whose last block is full takes the next id (rows in order, layers within a row,
// the order the torch form uses), with reference count 1 in `ref`; each appended slot gets
// its position and every state its fill (states as `state_runs` takes them). Returns the
// physical slots [L, b] to write this step's K/V to, the ids it took (the first `need`)
// and the most blocks a row then holds in a layer (`widest`, the width the step's
// attention reads). It counts its blocks itself, so a step makes one call where it made
// two (`decode_need`, then this), each paying for cold code and data right after the
// forward. Everything is checked before anything is written; where the tables are too
// narrow (`widest` over their width) or the ids too few (`need` over k) it writes nothing
// and returns no slots (an empty tensor) with the two counts, for the caller to widen the
// tables or take more ids and call again.
// `peaks` [Rt, 2] int64 keeps each row's most blocks
// (all layers) and live tokens (summed over layers // layers) right after an append.
// A layer that `ring_writes` takes no slot: its token goes over the ring's next slot, in
// a block only this row holds (checked), the cursor moves on within [sink, cap) and the
// row's overwritten count grows; its sizes stay.
std::tuple<at::Tensor, int64_t, int64_t> append_rows(
    at::Tensor table, at::Tensor slot_pos, at::Tensor sizes, at::Tensor peaks, at::Tensor ring,
    std::vector<at::Tensor> states, const at::Tensor& columns, std::vector<double> fills, at::Tensor ref,
    c10::IntArrayRef plan, int64_t b, int64_t bs) {
  const std::array<int64_t, 4> dims = check_tables(table, slot_pos, bs);
  const int64_t nl = dims[0], rt = dims[1], wt = dims[2], s = dims[3];
  check_sizes(sizes, rt, nl);
  check_ring(ring, rt, nl);
  TORCH_CHECK(ring.size(0) == sizes.size(0), "ring and sizes must have the same rows");
  int64_t* gp = ring.data_ptr<int64_t>();
  TORCH_CHECK(peaks.dim() == 2 && peaks.scalar_type() == at::kLong && peaks.is_contiguous() &&
              peaks.size(0) == sizes.size(0) && peaks.size(1) == 2, "peaks must be a contiguous [Rt, 2] int64 tensor");
  TORCH_CHECK(ref.dim() == 1 && ref.scalar_type() == at::kInt && ref.is_contiguous(), "ref must be [blocks] int32");
  TORCH_CHECK(b >= 0 && static_cast<int64_t>(plan.size()) >= 2 * b, "plan does not match b");
  TORCH_CHECK(fills.size() == states.size(), "one fill per state");
  const std::vector<StateRuns> st = state_runs(states, columns, nl, rt, s);
  const int64_t* p = plan.data();
  const int64_t *rows = p, *pos = p + b, *ids = p + 2 * b;
  const int64_t k = static_cast<int64_t>(plan.size()) - 2 * b;
  int64_t* tp = table.data_ptr<int64_t>();
  int64_t* sp = slot_pos.data_ptr<int64_t>();
  int64_t* zp = sizes.data_ptr<int64_t>();
  int32_t* refp = ref.data_ptr<int32_t>();
  // Right after the forward none of this is in cache, and each (row, layer) touches its
  // own lines: ask for all of them first, so that their misses overlap instead of
  // queueing behind each other (the sizes, then the table and position lines they point to).
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < rt, "row out of range");
    for (int64_t f = 0; f < 3 * nl; f += 8) __builtin_prefetch(zp + rows[i] * 3 * nl + f, 1);
  }
  for (int64_t i = 0; i < b; ++i) {
    const int64_t* z = zp + rows[i] * 3 * nl;
    for (int64_t l = 0; l < nl; ++l) {
      const int64_t lr = l * rt + rows[i], nxt = z[nl + l];
      __builtin_prefetch(tp + lr * wt + nxt / bs, 1);
      __builtin_prefetch(sp + lr * s + nxt, 1);
    }
  }
  int64_t need = 0, widest = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t* z = zp + rows[i] * 3 * nl;
    const int64_t* g = gp + rows[i] * (3 + nl);
    for (int64_t l = 0; l < nl; ++l) {
      const int64_t nb = z[l], nxt = z[nl + l];
      TORCH_CHECK(nb >= 0 && nxt >= 0 && nxt <= nb * bs, "sizes out of range");
      const int64_t lr = l * rt + rows[i];
      if (ring_writes(g, z, nl, l)) {
        const int64_t at = g[3 + l];
        TORCH_CHECK(at >= g[0] && at < g[1], "ring cursor out of range");
        const int64_t id = tp[lr * wt + at / bs];
        TORCH_CHECK(id >= 0 && id < ref.size(0) && refp[id] == 1, "a ring slot in a block not only this row's");
        widest = std::max(widest, nb);
      } else if (nxt == nb * bs) {
        ++need;
        widest = std::max(widest, nb + 1);
      } else {
        TORCH_CHECK(tp[lr * wt + nxt / bs] >= 0, "appending into a column with no block");
        widest = std::max(widest, nb);
      }
    }
  }
  if (need > k || widest > wt) return {at::empty({0}, table.options()), need, widest};
  for (int64_t j = 0; j < need; ++j) TORCH_CHECK(ids[j] >= 0 && ids[j] < ref.size(0), "new block out of range");
  at::Tensor out = at::empty({nl, b}, table.options());
  int64_t* op = out.data_ptr<int64_t>();
  int64_t* pk = peaks.data_ptr<int64_t>();
  int64_t taken = 0;
  for (int64_t i = 0; i < b; ++i) {
    int64_t* z = zp + rows[i] * 3 * nl;
    int64_t* g = gp + rows[i] * (3 + nl);
    int64_t blocks = 0, live = 0;
    for (int64_t l = 0; l < nl; ++l) {
      const int64_t lr = l * rt + rows[i];
      int64_t slot = z[nl + l];
      if (ring_writes(g, z, nl, l)) {
        slot = g[3 + l];
        g[3 + l] = slot + 1 == g[1] ? g[0] : slot + 1;
        ++g[2];
      } else {
        if (slot == z[l] * bs) {
          const int64_t id = ids[taken++];
          tp[lr * wt + z[l]] = id;
          refp[id] = 1;
          ++z[l];
        }
        ++z[nl + l];
        ++z[2 * nl + l];
      }
      blocks += z[l];
      live += z[2 * nl + l];
      sp[lr * s + slot] = pos[i];
      op[l * b + i] = tp[lr * wt + slot / bs] * bs + slot % bs;
      for (size_t t = 0; t < st.size(); ++t) {
        const float fill = static_cast<float>(fills[t]);
        const int64_t per = st[t].bytes / static_cast<int64_t>(sizeof(float));  // values a slot per run
        for (int64_t c = 0; c < st[t].runs; ++c) {
          float* v = reinterpret_cast<float*>(st[t].base + ((lr * st[t].runs + c) * s + slot) * st[t].bytes);
          std::fill(v, v + per, fill);
        }
      }
    }
    int64_t* q = pk + rows[i] * 2;
    q[0] = std::max(q[0], blocks);
    q[1] = std::max(q[1], live / nl);
  }
  return {out, need, widest};
}

// The rows' sizes ([Rt, 3, L] int64), checked, and every row's blocks and appended
// counts asked for at once: right after the forward they are cold.
const int64_t* row_sizes(const at::Tensor& sizes, c10::IntArrayRef rows) {
  TORCH_CHECK(sizes.dim() == 3, "sizes must be a contiguous [Rt, 3, L] int64 tensor");
  const int64_t rt = sizes.size(0), nl = sizes.size(2);
  check_sizes(sizes, rt, nl);
  const int64_t* zp = sizes.data_ptr<int64_t>();
  for (const int64_t row : rows) {
    TORCH_CHECK(row >= 0 && row < rt, "row out of range");
    for (int64_t f = 0; f < 2 * nl; f += 8) __builtin_prefetch(zp + row * 3 * nl + f);
  }
  return zp;
}

// Whether `append_rows` takes a block for layer l of a row: its last block is full and
// its token does not go over the row's ring.
inline bool takes_block(const int64_t* g, const int64_t* z, int64_t nl, int64_t l, int64_t bs) {
  return z[nl + l] >= z[l] * bs && !ring_writes(g, z, nl, l);
}

const int64_t* ring_rows(const at::Tensor& ring, const at::Tensor& sizes) {
  check_ring(ring, sizes.size(0), sizes.size(2));
  TORCH_CHECK(ring.size(0) == sizes.size(0), "ring and sizes must have the same rows");
  return ring.data_ptr<int64_t>();
}

// The blocks `append_rows` would take for these rows (a layer whose last block is full
// takes one) and the most blocks a row will then hold in a layer (the width the tables
// need). Asked once for a step's decoding rows, instead of every request in Python.
std::tuple<int64_t, int64_t> decode_need(const at::Tensor& sizes, const at::Tensor& ring,
                                         c10::IntArrayRef rows, int64_t bs) {
  const int64_t* zp = row_sizes(sizes, rows);
  const int64_t nl = sizes.size(2);
  const int64_t* gp = ring_rows(ring, sizes);
  int64_t need = 0, widest = 0;
  for (const int64_t row : rows) {
    const int64_t* z = zp + row * 3 * nl;
    const int64_t* g = gp + row * (3 + nl);
    for (int64_t l = 0; l < nl; ++l) {
      const bool full = takes_block(g, z, nl, l, bs);
      need += full;
      widest = std::max(widest, z[l] + full);
    }
  }
  return {need, widest};
}

// Per row, [held_0, need_0, held_1, need_1, ...]: blocks held over all layers, and blocks a
// decode append would take (`decode_need`'s count, row by row): the policy runner's
// reservation check of every request near its reservation, one call a step.
std::vector<int64_t> held_and_need(const at::Tensor& sizes, const at::Tensor& ring,
                                   c10::IntArrayRef rows, int64_t bs) {
  const int64_t* zp = row_sizes(sizes, rows);
  const int64_t nl = sizes.size(2);
  const int64_t* gp = ring_rows(ring, sizes);
  std::vector<int64_t> out;
  out.reserve(2 * rows.size());
  for (const int64_t row : rows) {
    const int64_t* z = zp + row * 3 * nl;
    const int64_t* g = gp + row * (3 + nl);
    int64_t held = 0, need = 0;
    for (int64_t l = 0; l < nl; ++l) {
      held += z[l];
      need += takes_block(g, z, nl, l, bs);
    }
    out.push_back(held);
    out.push_back(need);
  }
  return out;
}

// src[:, rows, :w] of an int64 [L, R, S] table (block ids or slot positions) into `out`
// [L, n, w], int32 or int64, contiguous: a CUDA graph step's tables written straight into
// its pinned staging buffer (engine/cuda_graphs.py), w columns a row where a gather of
// rows apart took every column of the S the tables have grown to, then a second copy.
// Also a policy's per-slot state (float32 [L, R, S] into float32 [L, n, w]): rows of the
// same dtype are copied as bytes. `put_rows_from` is the way back.
void take_rows_into(const at::Tensor& src, c10::IntArrayRef rows, at::Tensor out) {
  TORCH_CHECK(src.dim() == 3 && (src.scalar_type() == at::kLong || src.scalar_type() == at::kFloat) &&
              src.is_contiguous(), "src must be a contiguous [L, R, S] int64 or float32 tensor");
  const int64_t nl = src.size(0), rt = src.size(1), s = src.size(2);
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.size(0) == nl && out.size(1) == n &&
              out.size(2) <= s, "out must be a contiguous [L, len(rows), <= S] tensor");
  TORCH_CHECK(out.scalar_type() == src.scalar_type() ||
              (src.scalar_type() == at::kLong && out.scalar_type() == at::kInt),
              "out must be src's dtype (or int32 for int64 src)");
  for (const int64_t row : rows) TORCH_CHECK(row >= 0 && row < rt, "row out of range");
  const int64_t w = out.size(2);
  if (out.scalar_type() == src.scalar_type()) {
    const size_t e = src.element_size();
    const char* sp = static_cast<const char*>(src.data_ptr());
    char* op = static_cast<char*>(out.data_ptr());
    for (int64_t l = 0; l < nl; ++l)
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(op + (l * n + i) * w * e, sp + (l * rt + rows[i]) * s * e, w * e);
    return;
  }
  const int64_t* sp = src.data_ptr<int64_t>();
  int32_t* op = out.data_ptr<int32_t>();
  team::parallel_for(0, nl * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t* __restrict from = sp + ((k / n) * rt + rows[k % n]) * s;
      int32_t* __restrict to = op + k * w;
      for (int64_t j = 0; j < w; ++j) to[j] = static_cast<int32_t>(from[j]);  // vectorized
    }
  });
}

// dst[:, rows, :w] = src ([L, n, w], contiguous, dst's dtype): `take_rows_into`'s way back
// (kvpool/rows.put_rows), a row's w columns a copy, where index_copy_ over the narrowed
// tables walked them element by element.
void put_rows_from(at::Tensor dst, c10::IntArrayRef rows, const at::Tensor& src) {
  TORCH_CHECK(dst.dim() == 3 && dst.is_contiguous() && src.dim() == 3 && src.is_contiguous() &&
              src.scalar_type() == dst.scalar_type() && src.size(0) == dst.size(0) &&
              src.size(1) == static_cast<int64_t>(rows.size()) && src.size(2) <= dst.size(2),
              "dst must be a contiguous [L, R, S] tensor and src [L, len(rows), <= S] of its dtype");
  const int64_t nl = dst.size(0), rt = dst.size(1), s = dst.size(2);
  const int64_t n = src.size(1), w = src.size(2);
  for (const int64_t row : rows) TORCH_CHECK(row >= 0 && row < rt, "row out of range");
  const size_t e = dst.element_size();
  char* dp = static_cast<char*>(dst.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  for (int64_t l = 0; l < nl; ++l)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(dp + (l * rt + rows[i]) * s * e, sp + (l * n + i) * w * e, w * e);
}

// BlockPool.release's reference counting (its torch form: an index_add, a gather, a
// compare, a mask and a unique, each a dispatch that costs more than the work on the
// few ids a plan frees): drop one reference per id in `ids` (int64) from `ref` (int32),
// then return the ids whose count reached zero, sorted and unique.
at::Tensor release_refs(at::Tensor ref, const at::Tensor& ids) {
  TORCH_CHECK(ref.dim() == 1 && ref.scalar_type() == at::kInt && ref.is_contiguous(),
              "ref must be a contiguous [blocks] int32 tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be [n] int64");
  const at::Tensor x = ids.contiguous();
  const int64_t* ip = x.data_ptr<int64_t>();
  int32_t* rp = ref.data_ptr<int32_t>();
  const int64_t n = x.size(0), nb = ref.size(0);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < nb, "block id out of range");
  for (int64_t i = 0; i < n; ++i) --rp[ip[i]];
  std::vector<int64_t> dead;
  for (int64_t i = 0; i < n; ++i)
    if (rp[ip[i]] == 0) dead.push_back(ip[i]);
  std::sort(dead.begin(), dead.end());
  dead.erase(std::unique(dead.begin(), dead.end()), dead.end());
  at::Tensor out = at::empty({static_cast<int64_t>(dead.size())}, x.options());
  std::memcpy(out.data_ptr<int64_t>(), dead.data(), dead.size() * sizeof(int64_t));
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve_tables, m) {
  m.def("mark_dead(Tensor(a!) slot_pos, Tensor(b!) sizes, Tensor rows, Tensor dead, Tensor alike, int bs) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("free_dead(Tensor(a!) table, Tensor(b!) slot_pos, Tensor(c!) sizes, Tensor(d!)[] states, Tensor columns, "
        "Tensor rows, Tensor only, int bs) -> (Tensor, Tensor)");
  m.def("evict_rows(Tensor(a!) table, Tensor(b!) slot_pos, Tensor(c!) sizes, Tensor(d!)[] states, "
        "Tensor columns, Tensor rows, Tensor dead, Tensor alike, int bs) -> (Tensor, Tensor)");
  m.def("release_refs(Tensor(a!) ref, Tensor ids) -> Tensor");
  m.def("decode_need(Tensor sizes, Tensor ring, int[] rows, int bs) -> (int, int)");
  m.def("held_and_need(Tensor sizes, Tensor ring, int[] rows, int bs) -> int[]");
  m.def("take_rows_into(Tensor src, int[] rows, Tensor(a!) out) -> ()");
  m.def("put_rows_from(Tensor(a!) dst, int[] rows, Tensor src) -> ()");
  m.def("append_rows(Tensor(a!) table, Tensor(b!) slot_pos, Tensor(c!) sizes, Tensor(d!) peaks, "
        "Tensor(g!) ring, Tensor(e!)[] states, Tensor columns, float[] fills, Tensor(f!) ref, int[] plan, "
        "int b, int bs) "
        "-> (Tensor, int, int)");
  m.def("compact_rows(Tensor(a!) table, Tensor(b!) slot_pos, Tensor(c!) sizes, Tensor(d!)[] states, "
        "Tensor columns, Tensor(e!)[] flats, Tensor rows, Tensor only, Tensor ref, int bs) "
        "-> (bool, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve_tables, CPU, m) {
  m.impl("mark_dead", mark_dead);
  m.impl("free_dead", free_dead);
  m.impl("evict_rows", evict_rows);
  m.impl("compact_rows", compact_rows);
  m.impl("release_refs", release_refs);
  m.impl("append_rows", append_rows);
  m.impl("decode_need", decode_need);
  m.impl("held_and_need", held_and_need);
  m.impl("take_rows_into", take_rows_into);
  m.impl("put_rows_from", put_rows_from);
}
