// The K/V storage's own passes on CPU: a step's K/V writes (write_kv: KVStorage.write)
// and KeyDiff's key diversity per live slot, read from the pool's keys where they lie.
//
// Registered as torch.ops.kvserve_storage.key_diversity; attention/key_stats.py builds it on
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
#include <cstring>
#include <type_traits>
#include <utility>

#include "../../native/csrc/key_diversity.h"
#include "../../native/csrc/team.h"

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

// A step's new K and V rows [T, Hkv, D] (the strided views of the QKV GEMM's output) into
// their pool slots [T], in the pool's dtype: KVStorage.write, whose torch form is two
// index_puts, ~60 us each at 64 rows of the 3m model (half a millisecond of its 8 ms
// decode step for 8 writes). Converted as torch's .to() converts (round to nearest even; a
// NaN is written as the canonical NaN, where torch's vector conversion may keep its bits).
// `per_head`: the pool holds one kv head a slot ([slots, 1, D]) and token t's head h
// goes to slots[h * n + t] (the runner's per-head slots, head-major), so a layer's
// K/V [T, H, D] is written as it comes out of the projection, with no regrouping copy.
template <typename TS, typename TD>
void put_rows(const at::Tensor& src, at::Tensor& dst, const int64_t* slots, bool per_head) {
  const int64_t n = src.size(0), hkv = src.size(1), d = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  const TS* sp = src.data_ptr<TS>();
  TD* dp = dst.data_ptr<TD>();
  team::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < hkv; ++h) {
        const TS* x = sp + t * s0 + h * s1;
        TD* y = dp + (per_head ? slots[h * n + t] : slots[t] * hkv + h) * d;
        if constexpr (std::is_same_v<TS, TD>) {
          std::memcpy(y, x, d * sizeof(TD));
        } else {
          for (int64_t i = 0; i < d; ++i) y[i] = static_cast<TD>(static_cast<float>(x[i]));
        }
      }
  });
}

void write_kv(at::Tensor k_flat, at::Tensor v_flat, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "slots must be [T] int64");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < sl.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_flat.size(0), "slot out of range");
  for (auto [dst, src] : {std::pair<at::Tensor*, const at::Tensor*>{&k_flat, &k}, {&v_flat, &v}}) {
    TORCH_CHECK(dst->dim() == 3 && dst->is_contiguous(), "the pool planes must be contiguous [slots, Hkv, D]");
    TORCH_CHECK(src->dim() == 3 && src->stride(2) == 1 && src->size(2) == dst->size(2),
                "k and v must be [T, Hkv, D] with unit last stride");
    // a pool of the model's kv heads a slot: a slot a token; a per-head pool: a slot a
    // (kv head, token), head-major
    const bool per_head = dst->size(1) == 1 && src->size(1) > 1;
    TORCH_CHECK(per_head ? sl.size(0) == src->size(0) * src->size(1)
                         : src->size(0) == sl.size(0) && src->size(1) == dst->size(1),
                "slots must be [T] for k and v [T, Hkv, D] (or [Hkv * T] into a pool of one kv head a slot)");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src->scalar_type(), "write_kv", [&] {
      using TS = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst->scalar_type(), "write_kv", [&] {
        put_rows<TS, scalar_t>(*src, *dst, sp, per_head);
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY(kvserve_storage, m) {
  m.def("key_diversity(Tensor k_cache, Tensor table, Tensor positions) -> Tensor");
  m.def("write_kv(Tensor(a!) k_flat, Tensor(b!) v_flat, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_storage, CPU, m) {
  m.impl("key_diversity", key_diversity);
  m.impl("write_kv", write_kv);
}
