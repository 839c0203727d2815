"""The CPU decode path: a C++ kernel that reads keys and values from the pool's blocks in
place (`csrc/paged_decode_cpu.cpp`), built on first use.

Why: on CPU the torch path's decode is dominated not by the attention maths but by
copying every sequence's blocks into a padded tensor (`gather_blocks`) and building the
mask, once per layer per step — 28-37% of a decode step in the issue-2 profile. The
kernel walks each sequence's block table, skips invisible slots, and keeps one softmax
per (sequence, kv head) in fp32, so ragged lengths cost nothing and no copy is made.
Built with -march=native, it takes an AVX-512 path where the CPU has one (head dims
16/32/64/128: 16 slots' scores per step, GQA heads sharing each K and V load, rows
prefetched ahead), the same at 8 lanes where the CPU has AVX2 and FMA only (AMD Zen 1-3,
older Xeons: `csrc/paged_decode_avx2.h`; 2.7-3.3x the portable loop at the 3m shape on
a Zen 3 host, level where a layer's K/V stream from DRAM) and a portable loop elsewhere;
the same source builds on all three (`vector_path` says which this build took).
Sequences run in parallel; with fewer sequences than threads (one long chat), each is
cut into slices of its kv heads so that no core sits idle (a 1,800-token sequence of the
160M model: 1.13-1.17 ms a layer on one thread, 0.88-1.03 ms on two; memory-bound).

Like the torch path, it takes caches in another floating dtype than q: a bf16 or fp16
pool under an fp32 model (`kv_cache_dtype`) halves the bytes a decode step reads, which
is what bounds it (~2x faster for 30 sequences of ~1k slots at the 3m model's shape).
Each 16-bit value is widened exactly as it is loaded and the maths stays fp32, so the
only loss is the rounding when the pool was written; out is in q's dtype.

A quantized pool (int8, fp8 e4m3, int4; attention/quant.py) goes to a second op,
`paged_decode_quant`; the pool is never widened whole. int8 and fp8 keep one scale per
(slot, kv head), which factors out of a dot product, so they run the AVX-512 path over
the raw codes: each K tile's scores are multiplied by the slots' K scales and each
probability by its slot's V scale (fp8 codes widen through fp16 bit patterns). int4
(a scale per 32 channels) and unusual head dims dequantize each visible row as it is
read (portable loop). At the 3m shape (16 sequences of 512 slots, one thread) a layer's
decode call took 135 us over bf16, 160 over int8, 210 over fp8 and ~1,150 over int4
(int8 ~650 and fp8 ~800 on the portable loop before).

A fresh prompt (nothing cached before it) attends causally over its own keys in a second
C++ op on AVX-512 CPUs, `causal_prefill` (`csrc/causal_prefill.h`: FlashAttention's online
softmax with a query a vector lane, on kvserve's thread team): a 500-token prompt of the
160M model's shape 2.1x torch's fused SDPA in fp32 and 2.3x in bf16 in one process, more
in a server, whose OpenMP threads sleep (docs/benchmarks.md, "Prefill attention"); bf16
scores from bf16 dot products where the CPU has them, ~1.35x that (commit 823928c), except
on Intel (`PAIR_FMA`), where fp32 FMAs over widened K and V are 1.25-1.6x the dot products
(commit 57bae56). A chunk after a
cached prefix takes the same op with the pool (`prefix_prefill_cpu`: the prefix's visible
slots read from their blocks in place) where the pool holds the model's dtype unquantized
and no statistics are wanted; other chunks stay on the torch path.

The model's attention variants (Gemma 2's logit soft-capping, gpt-oss's learned sinks;
`attention.torch_attention.paged_attention` says what they are) run in every op here,
decode, quantized decode and the prompt's causal op alike; each call passes them only
where the model has them (`features`), so a plain model's calls are what they were.

The build needs a C++ compiler (torch.utils.cpp_extension, cached
under TORCH_EXTENSIONS_DIR); without one, or with KVSERVE_CPU_KERNEL=0, decode (and a fresh
prompt's attention) falls back to the torch path with a warning, so a CPU install never
fails over it.
"""

from __future__ import annotations

import logging

import torch

from attention.key_stats import native_key_diversity
from attention.quant import QuantCache
from attention.storage import KVStorage
from attention.torch_attention import causal_self_attention, paged_attention
from native.build import load_ops
from native.cpu import pair_fma

log = logging.getLogger(__name__)
_stale_warned = False
_loaded = False


def kernel_available() -> bool:
    """Build (once per process; the compiled library is cached on disk) and load the op.

    A library without `paged_decode_quant` or the latest argument (`heads`) is an older
    build of the same name (seen when checkouts of different versions share
    TORCH_EXTENSIONS_DIR and rebuild it in turn): decode then falls back to the torch
    path, and says so once. A yes is kept: the runner asks every layer of every step, and
    reading the op's schema was 15 us a call (~70 us of a 3m model's 9 ms decode step)."""
    global _stale_warned, _loaded
    if _loaded:
        return True
    if not load_ops("kvserve_paged_decode_cpu"):
        return False
    if hasattr(torch.ops.kvserve, "paged_decode_quant") and any(
            a.name == "heads" for a in torch.ops.kvserve.paged_decode.default._schema.arguments):
        _loaded = True
        return True
    if not _stale_warned:
        _stale_warned = True
        log.warning("the loaded kvserve_paged_decode_cpu library is an older build (no "
                    "paged_decode_quant or heads; another checkout shares TORCH_EXTENSIONS_DIR?): "
                    "using the torch path")
    return False


def vector_path() -> str | None:
    """The decode kernel's vector path in this build: "avx512", "avx2" or "portable"
    (what -march=native found on this CPU); None without the kernel."""
    return str(torch.ops.kvserve.paged_decode_isa()) if kernel_available() else None


# bf16 prompts' attention by fp32 FMAs over widened K and V rather than bf16 dot products
# (read once: the op is called per layer and prompt)
PAIR_FMA = pair_fma()


def features(softcap: float | None, sinks: torch.Tensor | None) -> dict:
    """The ops' keyword arguments for the attention variants a call has: none for a
    plain model (its calls stay as they were), else `softcap` (0: none) and `sinks`."""
    if softcap is None and sinks is None:
        return {}
    return {"softcap": float(softcap or 0.0), "sinks": sinks}


def causal_prefill_runs(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the `causal_prefill` op runs here for this dtype and head dim (an AVX-512
    build, fp32 or bf16, head dim 16/32/64/128)."""
    return (dtype in (torch.float32, torch.bfloat16) and head_dim in (16, 32, 64, 128)
            and vector_path() == "avx512")


def _rows_whole(x: torch.Tensor) -> bool:
    """Whether each row of x [T, H, D] holds its heads and channels in one run, as the
    `causal_prefill` op reads them (a view of a fused qkv output does)."""
    return x.stride(2) == 1 and (x.stride(1) == x.shape[2] or x.shape[1] == 1)


def causal_prefill_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       out: torch.Tensor | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None,
                       window: int | None = None) -> torch.Tensor:
    """`attention.torch_attention.causal_self_attention`'s contract (q [T, Hq, D], k/v [T, Hkv, D]
    -> [T, Hq, D], into `out` when given; `softcap`, `sinks` [Hq]) on the `causal_prefill`
    op where it runs (`causal_prefill_runs`, each row's heads and channels contiguous; the
    op writes a contiguous `out` itself); SDPA (or its explicit softmax) elsewhere, and
    where a sliding `window` is shorter than the chunk (the op has no window)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if window is not None and window < q.shape[0]:
        return causal_self_attention(q, k, v, scale, out, softcap, sinks, window)
    if causal_prefill_runs(q.dtype, q.shape[2]) and all(map(_rows_whole, (q, k, v))):
        kw = features(softcap, sinks)
        if out is None or out.is_contiguous():
            return torch.ops.kvserve.causal_prefill(q, k, v, float(scale), out=out, fma=PAIR_FMA,
                                                    **kw)
        return out.copy_(torch.ops.kvserve.causal_prefill(q, k, v, float(scale), fma=PAIR_FMA,
                                                          **kw))
    return causal_self_attention(q, k, v, scale, out, softcap, sinks)


def prefix_prefill_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                       slot_pos: torch.Tensor, start: int, scale: float,
                       out: torch.Tensor | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """A prompt chunk after a cached prefix (a prefix-cache hit, a long prompt's later
    chunk), `KVStorage.attend`'s contract: q [T, Hq, D] causal over its own k/v
    [T, Hkv, D] (positions start..start+T-1) and over every visible slot of its sequence
    before `start`, read from the pool's blocks in place (this layer's table [NB] and
    slot_pos [NB*bs]), on the `causal_prefill` op, into `out` when given (contiguous);
    `softcap`, `sinks` [Hq] as `causal_prefill_cpu`'s. Only where `prefix_prefill_runs`.

    Why: the torch path gathers every block of the group into a padded copy and runs SDPA
    under a [T, S] mask (profiled on AMD Zen 4 before commit cb6f198: the gather 14% and
    SDPA 15% of such a step); the op copies each prefix row once and runs the fresh
    prompt's tiles over it."""
    q, k, v = (x if _rows_whole(x) else x.contiguous() for x in (q, k, v))
    out = torch.ops.kvserve.causal_prefill(q, k, v, float(scale), k_cache, v_cache, table,
                                           slot_pos, int(start), out=out, fma=PAIR_FMA,
                                           **features(softcap, sinks))
    return out, None


def prefix_prefill_runs(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype,
                        quantized: bool) -> bool:
    """Whether `prefix_prefill_cpu` runs here: the `causal_prefill` op for this dtype and
    head dim, over an unquantized pool of the model's own dtype."""
    return not quantized and cache_dtype == dtype and causal_prefill_runs(dtype, head_dim)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    return_probs: bool = False,
    quant: QuantCache | None = None,
    sum_heads: bool = False,
    table_rows: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    ring: torch.Tensor | None = None,
    ring_total: torch.Tensor | None = None,
    ring_cols: torch.Tensor | None = None,
    ring_shift: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    heads: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `attention.torch_attention.paged_attention` (`softcap` and `sinks`
    included); decode rows use the kernel.

    `sum_heads`: the kernel may return the mass summed over the kv heads, [B, 1, 1, S]
    (the heads added in order, as the policy bridge's `head_sum` adds them: the same
    bits, half the bytes at two kv heads); the other paths return it per kv head.
    `table_rows` [B] int64: `table` and `slot_pos` are the engine's tables whole
    ([R, NB], [R, NB*bs]) and sequence b reads row `table_rows[b]` in place (a step's
    rows that are not consecutive, `SlotTables.rows_of`); the torch path gathers them.
    `accumulate` [R, >= NB*bs] float32 (rows as `table`'s): the kernel adds each decode
    row's mass, summed over every head, into it as it writes it, and returns no mass
    (H2O's cumulative attention, `Needs.accumulate`). `ring` [R, α, >= NB*bs] and
    `ring_total` [R, 3, >= NB*bs] float32 (a state stored by columns, rows as `table`'s)
    and `ring_cols` [B] int64: the kernel writes each decode row's mass, summed over
    every head, as column ring_cols[b] of its ring and keeps the ring's exact total
    (pyramid's observation window, `Needs.ring`; native/csrc/window_ring.h), and
    returns no mass. Both on the kernel only, a float pool and the mass summed over
    the heads (`accumulates`).
    `heads` > 1, decode rows on the kernel only: a per-head pool's call (`--kv-layout
    head`) with q [B, 1, Hq, D] as the model gives it, each sequence's kv head h a row of
    its own, row h·B + b of the tables (or of `table_rows`' blocks: row h·(R/heads) +
    table_rows[b]), of the mass and of `accumulate`'s/`ring`'s rows, reading and writing
    q's query heads [h·Hq/heads, (h+1)·Hq/heads) in place: no regrouping of q and the
    output around the call (engine/attention_groups.by_head); `q_pos` and `ring_cols`
    stay [B]; `sinks` [Hq]."""
    kw = features(softcap, sinks)
    if heads > 1:
        kw["heads"] = heads
    if accumulate is not None or ring is not None:
        assert q.shape[1] == 1 and quant is None and (sum_heads or k_cache.shape[2] == 1)
        out, _, _ = torch.ops.kvserve.paged_decode(
            q[:, 0], k_cache, v_cache, table, slot_pos, q_pos.reshape(-1), float(scale),
            int(window or 0), True, None, sum_heads, table_rows, accumulate, ring, ring_total,
            ring_cols, ring_shift, **kw)
        return out[:, None], None
    if q.shape[1] != 1 or not kernel_available():
        assert heads == 1, "a per-head call runs on the kernel"
        if table_rows is not None:
            table, slot_pos = table.index_select(0, table_rows), slot_pos.index_select(0, table_rows)
        return paged_attention(q, k_cache, v_cache, table, slot_pos, q_pos, scale, window,
                               return_probs, quant, softcap, sinks)
    if quant is not None:  # codes reinterpreted as bytes; the kernel decodes them
        out, mass = torch.ops.kvserve.paged_decode_quant(
            q[:, 0], k_cache.view(torch.uint8), v_cache.view(torch.uint8), quant.k_scale,
            quant.v_scale, table, slot_pos, q_pos.reshape(-1), float(scale),
            int(window or 0), return_probs, quant.fmt.code, table_rows, **kw,
        )
        return out[:, None], (mass[:, None] if return_probs else None)
    out, mass, _ = torch.ops.kvserve.paged_decode(
        q[:, 0], k_cache, v_cache, table, slot_pos, q_pos.reshape(-1), float(scale),
        int(window or 0), return_probs, None, sum_heads, table_rows, **kw,
    )
    return out[:, None], (mass[:, None] if return_probs else None)


def accumulates(pool: KVStorage) -> bool:
    """Whether decode rows' mass can go into a per-slot state inside the kernel
    (`paged_attention_cpu(accumulate=, ring=)`, which also need the mass summed over the
    kv heads there): the kernel built, with the arguments, and a float pool."""
    return pool.quant is None and kernel_available()


def fuses_key_diversity(pool: KVStorage, windows: list[int | None]) -> bool:
    """Whether `paged_decode_key_diversity` serves this pool: the kernel built, a float
    pool on the CPU (the op's dtypes) and no sliding window (decode then sees exactly the
    live slots KeyDiff scores)."""
    return (pool.quant is None and native_key_diversity(pool.k_cache)
            and all(w is None for w in windows) and kernel_available())


def paged_decode_key_diversity(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    slot_pos: torch.Tensor, q_pos: torch.Tensor, scale: float, window: int | None = None,
    return_probs: bool = False, sum_heads: bool = False, rows: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, heads: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`paged_attention_cpu` of decode rows (q [B, 1, Hq, D]) that also returns KeyDiff's
    score of every visible slot, [B, S] float32 (0 where none), of the rows flagged in
    `rows` ([B] bool; all by default, the others stay 0): `attention.key_stats`'
    `key_diversity`, the same bits (one C++ code path, key_diversity.h), computed per
    sequence right after its attention read its keys. They are then in cache, where the
    separate op read every live key from DRAM again after the step: at 16 requests of
    ~1k tokens that op was ~1 ms, ~20% of a 3m model's decode step (issue 18: a policy's
    statistics accumulated during attention, not gathered after the step). Callers
    check `fuses_key_diversity` first. `table_rows`, `softcap`, `sinks`, `heads`: as
    `paged_attention_cpu`'s (`rows` [B] a sequence; the scores a call's row)."""
    assert q.shape[1] == 1 and not window, "decode rows without a window"
    out, mass, kd = torch.ops.kvserve.paged_decode(
        q[:, 0], k_cache, v_cache, table, slot_pos, q_pos.reshape(-1), float(scale), 0,
        return_probs, torch.ones(q.shape[0], dtype=torch.bool) if rows is None else rows,
        sum_heads, table_rows, **features(softcap, sinks), heads=heads,
    )
    return out[:, None], (mass[:, None] if return_probs else None), kd
