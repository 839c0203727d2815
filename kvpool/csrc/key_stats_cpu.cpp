// KeyDiff's key diversity per live slot, read from the pool's keys where they lie.
//
// Registered as torch.ops.kvserve_keys.key_diversity; kvpool/key_stats.py builds it on
// first use and documents the contract, and policies/norms.py::keydiff_scores is the
// reference (and the fallback: no compiler, a quantized pool, another device).
// Why a kernel: the anchor (the mean unit key of a row's live slots) moves every step,
// so every live key is read every step, but the torch form also copies them all into a
// padded fp32 [rows, slots, heads, dim] tensor and makes about six passes over it
// (normalise, mask, sum, divide, matmul, mean). Here each row reads its keys twice in
// place (pass 1: the norms and the anchor; pass 2: the cosines, its keys still in cache)
// and writes one float per slot; rows run in parallel.
//
// The maths is key_diversity.h's, which the decode kernel also runs over each sequence's
// keys right after its attention (paged_decode_cpu.cpp: the same bits, and the keys read
// from DRAM once a step instead of twice). Dead slots (position -1, or no block) score 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "key_diversity.h"
#include "team.h"

namespace {

template <typename T>
struct Rows {  // one call's inputs, raw
  const T* k;             // [blocks, bs, Hkv, D]
  const int64_t* table;   // [N, nb]
  const int64_t* pos;     // [N, W]
  float* out;             // [N, W]
  int64_t nb, W, bs, H, D;
};

// One row: its live slots listed (key row pointers, slot order), then scored.
template <typename T>
void score_row(const Rows<T>& a, int64_t r, keydiff::Scratch& s) {
  const int64_t HD = a.H * a.D;
  const int64_t* pos = a.pos + r * a.W;
  const int64_t* tab = a.table + r * a.nb;
  float* out = a.out + r * a.W;
  std::fill(out, out + a.W, 0.f);
  const T** rows = reinterpret_cast<const T**>(s.rows.data());
  int64_t* logical = s.logical.data();
  int64_t n = 0;
  for (int64_t j = 0; j < a.W; ++j) {
    const int64_t blk = tab[j / a.bs];
    if (pos[j] < 0 || blk < 0) continue;
    rows[n] = a.k + (blk * a.bs + j % a.bs) * HD;
    logical[n++] = j;
  }
  if (n > 0) keydiff::score_listed<T>(n, a.H, a.D, out, s);
}

// k_cache [blocks, bs, Hkv, D] (fp32, bf16 or fp16, contiguous); table [N, nb] int64
// (-1: no block); positions [N, W] int64 (-1: dead; W <= nb * bs). -> [N, W] float32.
at::Tensor key_diversity(const at::Tensor& k_cache, const at::Tensor& table,
                         const at::Tensor& positions) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous(),
              "k_cache must be a contiguous [blocks, bs, Hkv, D] tensor");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "k_cache must be float32, bfloat16 or float16 (got ", dt, ")");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong, "table must be [N, nb] int64");
  TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong &&
                  positions.size(0) == table.size(0), "positions must be [N, W] int64");
  const int64_t n = table.size(0), nb = table.size(1), w = positions.size(1);
  const int64_t bs = k_cache.size(1), h = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(w <= nb * bs, "positions has more slots than the table's blocks");
  const at::Tensor t = table.contiguous(), p = positions.contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(tp[i] < k_cache.size(0), "block id out of range");
  at::Tensor out = at::empty({n, w}, positions.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "key_diversity", [&] {
    const Rows<scalar_t> a{k_cache.data_ptr<scalar_t>(), tp, p.data_ptr<int64_t>(),
                           out.data_ptr<float>(), nb, w, bs, h, d};
    team::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      keydiff::Scratch s(w, h, d);
      for (int64_t r = begin; r < end; ++r) score_row(a, r, s);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve_keys, m) {
  m.def("key_diversity(Tensor k_cache, Tensor table, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_keys, CPU, m) { m.impl("key_diversity", key_diversity); }
