"""Triton kernels for attention over the paged pool (GPU path of `paged_attention`).

Same contract as `kvpool.attention.paged_attention` (the torch path is the reference):
visibility is decided by slot positions alone (filled, causal, optional window), so
decode, chunked prefill over a cached prefix and evicted slots are one code path.

Design, and why:
- One program owns a (sequence, kv head, tile of query rows). The rows are the
  `Tq × G` queries of a GQA group flattened t-major (row = t*G + g), so each K/V tile
  is loaded once for all query heads that share it. That is what makes decode
  (Tq = 1) efficient: G rows per program instead of G programs re-reading the cache.
- The program walks the sequence's logical slots in tiles of BLOCK_N, addressing
  every slot through the block table (`table[s // block_size]`), so BLOCK_N does not
  depend on the pool's block size (4, 8, 16 all work) and -1 table pads cost nothing
  but a skipped tile. Tiles where no row sees any slot (evicted, beyond the causal
  edge or outside the window) are skipped before K/V are loaded.
- Online softmax in base 2 with fp32 accumulation; every load is upcast to fp32.
- One-token rows (decode steps, the CUDA graphs' only kind) run `_decode_kernel`, the
  same maths with a loop that keeps several loads in flight (its docstring says how):
  1.5x the general kernel's speed at the 160M model's decode shape on an H200.
- Flash-decoding split: when (sequences × kv heads) cannot fill the GPU, the slot
  range is split across programs and a small kernel merges the partial (acc, max,
  sum) triples. Decode with few long sequences would otherwise use a few SMs.
- `return_probs` is a second pass run only when asked: with the row log-sum-exp from
  the first pass known, each program recomputes one slot tile's scores for every
  query head of its group and writes the summed probabilities. No atomics, so the
  statistic that drives eviction is deterministic.

- A quantized pool (kvpool/quant.py) is decoded in `_load_rows` as each tile is loaded:
  codes times their fp16 scale, fp8 e4m3 decoded from its bits (so the interpreter and
  GPUs without fp8 loads read it alike). Nothing is widened outside the tile.

Rows that see no slot at all give zeros (as the SDPA branch of the reference does;
its explicit-softmax branch gives NaN there).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from kvpool.attention import paged_attention
from kvpool.cpu_attention import kernel_available, paged_attention_cpu
from kvpool.quant import QuantCache

try:  # CPU installs may lack triton: they still import this module and use torch.
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

    def _jit(fn):  # type: ignore[no-redef]
        return fn


_LOG2E = 1.4426950408889634
# One-token rows run `_decode_kernel` unless this is False: benchmarks/bench_gpu's row that
# measures the general kernel in the same run.
DECODE_KERNEL = True


@_jit
def _load_rows(PTR, SC, blk, off, kvh, d, sn, ss, sh, sd, scn, scs, sch, scg, mask,
               QUANT: tl.constexpr, GS: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of K or V in fp32; a quantized pool's codes are decoded
    and scaled here, as they are loaded (kvpool/quant.py: 1 int8, 2 fp8 e4m3 read as
    bytes and decoded by its bits, 3 int4 two per byte, offset 8)."""
    base = blk[:, None] * sn + off[:, None] * ss + kvh * sh
    if QUANT == 3:
        c = tl.load(PTR + base + (d[None, :] // 2) * sd, mask=mask, other=0).to(tl.int32)
        x = (((c >> ((d[None, :] % 2) * 4)) & 15) - 8).to(tl.float32)
    elif QUANT == 2:
        c = tl.load(PTR + base + d[None, :] * sd, mask=mask, other=0).to(tl.int32)
        e = (c >> 3) & 15
        m = (c & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * tl.exp2((e - 10).to(tl.float32)))
        x = tl.where((c & 128) != 0, -mag, mag)
    else:
        x = tl.load(PTR + base + d[None, :] * sd, mask=mask, other=0).to(tl.float32)
    if QUANT > 0:
        s = tl.load(SC + blk[:, None] * scn + off[:, None] * scs + kvh * sch
                    + (d[None, :] // GS) * scg, mask=mask, other=0.0).to(tl.float32)
        x = x * s
    return x


@_jit
def _attn_kernel(
    Q, K, V, KS, VS, TABLE, SLOT_POS, Q_POS, OUT, LSE, O_PART, M_PART, L_PART, SLEN,
    sq_b, sq_t, sq_h, sq_d,
    sk_n, sk_s, sk_h, sk_d,
    sv_n, sv_s, sv_h, sv_d,
    sc_n, sc_s, sc_h, sc_g,
    st_b, st_n, ssp_b, ssp_s, sqp_b, sqp_t,
    so_b, so_t, so_h, so_d,
    scale_log2, window, Tq, S, Hkv, tiles_per_split,
    G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr, GS: tl.constexpr, DYN_S: tl.constexpr,
):
    """Online-softmax attention of one (query-row tile, sequence × kv head, split).
    DYN_S: only the first SLEN[0] slots of each row are walked (a CUDA graph's static
    tables are wider than the step's; what lies beyond is stale)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Tq * G
    t = rows // G
    h = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    qp = tl.load(Q_POS + b * sqp_b + t * sqp_t, mask=row_ok, other=0).to(tl.int64)
    q = tl.load(Q + b * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale_log2  # scores come out in log2 units: exp2 instead of exp

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if DYN_S:
        S = tl.minimum(tl.load(SLEN).to(tl.int32), S)
    first = pid_s * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(S, BLOCK_N))
    for tile in range(first, last):
        s = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        s_ok = s < S
        sp = tl.load(SLOT_POS + b * ssp_b + s * ssp_s, mask=s_ok, other=-1).to(tl.int64)
        vis = (sp[None, :] >= 0) & (sp[None, :] <= qp[:, None]) & row_ok[:, None]
        if HAS_WINDOW:
            vis = vis & (sp[None, :] > qp[:, None] - window)
        if tl.max(tl.max(vis.to(tl.int32), axis=1), axis=0) > 0:
            blk = tl.load(TABLE + b * st_b + (s // BS) * st_n, mask=s_ok, other=0)
            blk = tl.maximum(blk, 0).to(tl.int64)  # -1 pads read block 0, as the reference
            off = s % BS
            # slots no row sees are not read: zeros, never a dead slot's stale NaN
            seen = tl.max(vis.to(tl.int32), axis=0) > 0
            kv_ok = seen[:, None] & d_ok[None, :]
            k = _load_rows(K, KS, blk, off, kvh, d, sk_n, sk_s, sk_h, sk_d,
                           sc_n, sc_s, sc_h, sc_g, kv_ok, QUANT, GS)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            scores = tl.where(vis, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN on empty rows
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(scores - m_use[:, None])
            v = _load_rows(V, VS, blk, off, kvh, d, sv_n, sv_s, sv_h, sv_d,
                           sc_n, sc_s, sc_h, sc_g, kv_ok, QUANT, GS)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new

    if SPLIT:  # partials [B*Hkv, splits, Tq*G, (BLOCK_D)], merged by _combine_kernel
        base = (pid_bh * tl.num_programs(2) + pid_s) * Tq * G + rows
        tl.store(M_PART + base, m_i, mask=row_ok)
        tl.store(L_PART + base, l_i, mask=row_ok)
        tl.store(O_PART + base[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :] * so_d,
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), 0.0)
            tl.store(LSE + (b * Tq + t) * (Hkv * G) + h, lse, mask=row_ok)


@_jit
def _decode_kernel(
    Q, K, V, KS, VS, TABLE, SLOT_POS, Q_POS, OUT, LSE, O_PART, M_PART, L_PART, SLEN,
    sq_b, sq_h, sq_d,
    sk_n, sk_s, sk_h, sk_d,
    sv_n, sv_s, sv_h, sv_d,
    sc_n, sc_s, sc_h, sc_g,
    st_b, st_n, ssp_b, ssp_s, sqp_b,
    so_b, so_h, so_d,
    scale_log2, window, S, Hkv, tiles_per_split,
    G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr, GS: tl.constexpr, DYN_S: tl.constexpr,
):
    """One query token of one (sequence, kv head, split): the decode step's attention.

    Why apart from `_attn_kernel`: its loop skips a tile no row sees with an `if`
    around the loads, which keeps them in program order (positions, then block ids,
    then K, then V after the scores: four dependent round trips to memory a tile).
    Here the loop has no branch: K and V are loaded together at the top of each tile,
    masked by visibility (an evicted, windowed-out or padded slot costs no memory
    traffic and reads zeros, never a stale NaN), and the next tile's positions and
    block ids are loaded a tile ahead. The group's G rows are padded to GP >= 16 for
    `tl.dot`: on an H200 that beat scores and output as fp32 broadcast products (the
    form SGLang's and LightLLM's MHA decode kernels take) by 1.5x at G = 1 and 5x at
    G = 4 (session 34's sweep, docs/benchmarks.md); its padding rows cost no memory."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv

    g = tl.arange(0, GP)
    g_ok = g < G
    h = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    qp = tl.load(Q_POS + b * sqp_b).to(tl.int64)
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale_log2  # scores come out in log2 units: exp2 instead of exp

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)

    if DYN_S:
        S = tl.minimum(tl.load(SLEN).to(tl.int32), S)
    first = pid_s * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(S, BLOCK_N))
    # A tile's positions and block ids are loaded one tile ahead, so that within a
    # tile only the K/V loads wait on memory (else three dependent round trips a tile).
    s = first * BLOCK_N + tl.arange(0, BLOCK_N)
    sp = tl.load(SLOT_POS + b * ssp_b + s * ssp_s, mask=s < S, other=-1)
    blk = tl.load(TABLE + b * st_b + (s // BS) * st_n, mask=s < S, other=0)
    for _tile in range(first, last):
        s_next = s + BLOCK_N
        sp_next = tl.load(SLOT_POS + b * ssp_b + s_next * ssp_s, mask=s_next < S, other=-1)
        blk_next = tl.load(TABLE + b * st_b + (s_next // BS) * st_n, mask=s_next < S, other=0)
        pos = sp.to(tl.int64)
        vis = (pos >= 0) & (pos <= qp)
        if HAS_WINDOW:
            vis = vis & (pos > qp - window)
        rows_at = tl.maximum(blk, 0).to(tl.int64)
        off = s % BS
        kv_ok = vis[:, None] & d_ok[None, :]
        k = _load_rows(K, KS, rows_at, off, kvh, d, sk_n, sk_s, sk_h, sk_d,
                       sc_n, sc_s, sc_h, sc_g, kv_ok, QUANT, GS)
        v = _load_rows(V, VS, rows_at, off, kvh, d, sv_n, sv_s, sv_h, sv_d,
                       sc_n, sc_s, sc_h, sc_g, kv_ok, QUANT, GS)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(vis[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN on empty rows
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
        s, sp, blk = s_next, sp_next, blk_next

    if SPLIT:  # partials [B*Hkv, splits, G, (BLOCK_D)], merged by _combine_kernel
        base = (pid_bh * tl.num_programs(1) + pid_s) * G + g
        tl.store(M_PART + base, m_i, mask=g_ok)
        tl.store(L_PART + base, l_i, mask=g_ok)
        tl.store(O_PART + base[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + b * so_b + h[:, None] * so_h + d[None, :] * so_d,
                 out.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), 0.0)
            tl.store(LSE + b * (Hkv * G) + h, lse, mask=g_ok)


@_jit
def _combine_kernel(
    O_PART, M_PART, L_PART, OUT, LSE,
    so_b, so_t, so_h, so_d,
    Tq, Hkv, splits,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """Merge the split-KV partial softmax states of one row tile into the output."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Tq * G
    t = rows // G
    h = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)

    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i in range(splits):
        base = (pid_bh * splits + i) * Tq * G + rows
        m_max = tl.maximum(m_max, tl.load(M_PART + base, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(splits):
        base = (pid_bh * splits + i) * Tq * G + rows
        w = tl.exp2(tl.load(M_PART + base, mask=row_ok, other=float("-inf")) - m_use)
        l_tot += w * tl.load(L_PART + base, mask=row_ok, other=0.0)
        o = tl.load(O_PART + base[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None], other=0.0)
        acc += w[:, None] * o
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    tl.store(OUT + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :] * so_d,
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < D))
    if STORE_LSE:
        lse = tl.where(l_tot > 0, m_use + tl.log2(tl.where(l_tot > 0, l_tot, 1.0)), 0.0)
        tl.store(LSE + (b * Tq + t) * (Hkv * G) + h, lse, mask=row_ok)


@_jit
def _probs_kernel(
    Q, K, KS, TABLE, SLOT_POS, Q_POS, LSE, PROBS,
    sq_b, sq_t, sq_h, sq_d,
    sk_n, sk_s, sk_h, sk_d,
    sc_n, sc_s, sc_h, sc_g,
    st_b, st_n, ssp_b, ssp_s, sqp_b, sqp_t,
    SLEN, ROWS, scale_log2, window, Tq, S, Hkv,
    G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, QUANT: tl.constexpr, GS: tl.constexpr,
    SUM_KV: tl.constexpr, DYN_S: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    """probs[b, t, kvh, s] = Σ_g exp2(score - lse) for one (slot tile, query tile).

    SUM_KV: one program walks every kv head of its row and writes the sum over all
    query heads, probs[b, t, 0, s] (what a policy that reads no head apart takes): the
    same sum without atomics, so the statistic stays deterministic. DYN_S: only the
    first SLEN[0] slots are read or written (a CUDA graph's tables are wider than the
    step's). HAS_ROWS: rows b with ROWS[b] == 0 want no mass and get zeros."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_t = tl.program_id(2)
    if SUM_KV:
        b = pid_bh
        kv_first = 0
        kv_count = Hkv
    else:
        b = pid_bh // Hkv
        kv_first = pid_bh % Hkv
        kv_count = 1
    if DYN_S:
        S_read = tl.minimum(tl.load(SLEN).to(tl.int32), S)
    else:
        S_read = S
    s = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s_ok = s < S_read
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < Tq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    sp = tl.load(SLOT_POS + b * ssp_b + s * ssp_s, mask=s_ok, other=-1).to(tl.int64)
    qp = tl.load(Q_POS + b * sqp_b + t * sqp_t, mask=t_ok, other=0).to(tl.int64)
    vis = (sp[None, :] >= 0) & (sp[None, :] <= qp[:, None]) & t_ok[:, None]
    if HAS_WINDOW:
        vis = vis & (sp[None, :] > qp[:, None] - window)
    if HAS_ROWS:
        vis = vis & (tl.load(ROWS + b) != 0)
    mass = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if tl.max(tl.max(vis.to(tl.int32), axis=1), axis=0) > 0:
        blk = tl.maximum(tl.load(TABLE + b * st_b + (s // BS) * st_n, mask=s_ok, other=0), 0)
        for j in range(kv_count):
            kvh = kv_first + j
            k = _load_rows(K, KS, blk.to(tl.int64), s % BS, kvh, d, sk_n, sk_s, sk_h, sk_d,
                           sc_n, sc_s, sc_h, sc_g, s_ok[:, None] & d_ok[None, :], QUANT, GS)
            for g in range(G):
                h = kvh * G + g
                q = tl.load(Q + b * sq_b + t[:, None] * sq_t + h * sq_h + d[None, :] * sq_d,
                            mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                q = q * scale_log2  # same rounding as the first pass
                lse = tl.load(LSE + (b * Tq + t) * (Hkv * G) + h, mask=t_ok, other=0.0)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                mass += tl.where(vis, tl.exp2(scores - lse[:, None]), 0.0)
    if SUM_KV:
        row = b.to(tl.int64) * Tq + t
    else:
        row = (b.to(tl.int64) * Tq + t) * Hkv + kv_first  # int64: B*Tq*Hkv*S can pass 2**31
    tl.store(PROBS + row[:, None] * S + s[None, :], mass,
             mask=t_ok[:, None] & s_ok[None, :])


def _pow2(n: int, lo: int = 16) -> int:
    """Tile sizes are powers of two, at least 16 (the smallest tl.dot operand)."""
    return max(lo, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter: splitting buys nothing there


def _auto_splits(programs: int, n_tiles: int, device: torch.device) -> int:
    """Split the slot range only when the grid cannot fill the GPU (long decode).

    Aim for ~2 waves of programs, and keep >= 4 slot tiles per split so the merge
    stays cheap next to the work it parallelises.
    """
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), n_tiles // 4, 64))


def paged_attention_triton(
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
    *,
    num_splits: int | None = None,
    slot_count: torch.Tensor | None = None,
    sum_heads: bool = False,
    mass_rows: torch.Tensor | None = None,
    tiles: tuple[int, ...] | None = None,
    decode: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of `kvpool.attention.paged_attention` (same arguments and results).

    `num_splits` (keyword only) forces the split-KV factor; None picks it from the
    grid size and the GPU's SM count. `slot_count` (keyword only): a one-element int
    tensor on the device; only the first `slot_count[0]` slots of every row are read
    (a CUDA graph's tables have a fixed width, wider than the step's; the count is read
    on the device at replay, engine/cuda_graphs.py); with `return_probs`, the mass
    beyond it is zero. `sum_heads`: the mass summed over every head,
    [B, Tq, 1, S] (the C++ kernel's flag: what a policy that reads no head apart takes).
    `mass_rows` ([B] int32 on the device): only rows b with mass_rows[b] != 0 get mass, the rest
    zeros (a graph's batch where some requests ask for it). `decode`: one query
    token a row runs `_decode_kernel` (None: whenever Tq == 1, unless `DECODE_KERNEL`
    is off; False forces the general kernel, the benchmark's comparison). `tiles`:
    (BLOCK_N, num_warps, num_stages) of the attention pass instead of the defaults (the
    GPU benchmark's sweep, benchmarks/bench_gpu_kernels.py). Every tensor is addressed
    through its strides, so views need no copy (q sliced out of a fused qkv
    projection, k_cache = kv[0]).
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use kvpool.attention.paged_attention")
    b, tq, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if quant is not None:  # fp8 codes travel as bytes and are decoded by their bits
        k_scale, v_scale, mode = quant.k_scale, quant.v_scale, quant.fmt.code
        if mode == 2:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        gs = quant.fmt.group_size(d)
    else:
        k_scale = v_scale = k_cache  # placeholders, never read
        mode, gs = 0, d
    sc_strides = k_scale.stride() if quant is not None else (0, 0, 0, 0)
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    g = hq // hkv
    nb = table.shape[1]
    s_len = nb * bs
    if slot_pos.shape != (b, s_len) or q_pos.shape != (b, tq):
        raise ValueError("slot_pos must be [B, NB*block_size] and q_pos [B, Tq]")
    dev = q.device
    out = torch.empty((b, tq, hq, d), dtype=q.dtype, device=dev)
    probs = (torch.zeros((b, tq, 1 if sum_heads else hkv, s_len), dtype=torch.float32,
                         device=dev) if return_probs else None)
    if out.numel() == 0 or s_len == 0:
        return out.zero_(), probs

    block_d = _pow2(d)
    rows = tq * g
    decode = (tq == 1 and DECODE_KERNEL) if decode is None else decode
    if decode:
        if tq != 1:
            raise ValueError("the decode kernel takes one query token a row")
        block_m = _pow2(g)  # the group's rows, padded (GP)
        # session 34's H200 sweep (64 x 384 slots, head_dim 64): 128 slots a tile for
        # MHA (0.030 ms a layer against 0.035 at 64), 64 for G = 4 (0.020 against 0.023)
        default_n = 128 if g == 1 and block_d <= 64 else 64 if block_d <= 64 else 32
        m_tiles = 1
    else:
        block_m = min(_pow2(rows), 64)
        default_n = 64 if block_d <= 64 else 32
        m_tiles = triton.cdiv(rows, block_m)
    block_n, warps, stages = tiles[:3] if tiles else (default_n, 4, None)
    block_n = min(block_n, _pow2(s_len))
    n_tiles = triton.cdiv(s_len, block_n)
    if num_splits is None:
        num_splits = _auto_splits(m_tiles * b * hkv, n_tiles, dev)
    tiles_per_split = triton.cdiv(n_tiles, max(1, min(num_splits, n_tiles)))
    splits = triton.cdiv(n_tiles, tiles_per_split)  # no empty splits
    # 16-bit inputs carry <= 10 mantissa bits, so tf32 tensor-core dots lose nothing on
    # q·k (and ~5e-4 relative on p·v); fp32 inputs get exact IEEE dots, like torch.
    precision = "ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32"
    lse = torch.empty((b, tq, hq), dtype=torch.float32, device=dev) if return_probs else out
    if splits > 1:
        o_part = torch.empty((b * hkv, splits, rows, block_d), dtype=torch.float32, device=dev)
        m_part = torch.empty((b * hkv, splits, rows), dtype=torch.float32, device=dev)
        l_part = torch.empty_like(m_part)
    else:
        o_part = m_part = l_part = out  # unused placeholders
    scale_log2 = float(scale) * _LOG2E
    win = int(window) if window is not None else 0

    s_lens = q_pos if slot_count is None else slot_count  # SLEN: unread if None
    launch = {"num_warps": warps, **({} if stages is None else {"num_stages": stages})}
    if decode:
        _decode_kernel[(b * hkv, splits)](
            q, k_cache, v_cache, k_scale, v_scale, table, slot_pos, q_pos, out, lse, o_part,
            m_part, l_part, s_lens, q.stride(0), q.stride(2), q.stride(3),
            *k_cache.stride(), *v_cache.stride(), *sc_strides, *table.stride(),
            *slot_pos.stride(), q_pos.stride(0), out.stride(0), out.stride(2), out.stride(3),
            scale_log2, win, s_len, hkv, tiles_per_split,
            G=g, GP=block_m, BS=bs, D=d, BLOCK_D=block_d, BLOCK_N=block_n,
            HAS_WINDOW=window is not None, SPLIT=splits > 1, STORE_LSE=return_probs,
            PRECISION=precision, QUANT=mode, GS=gs, DYN_S=slot_count is not None, **launch,
        )
    else:
        _attn_kernel[(m_tiles, b * hkv, splits)](
            q, k_cache, v_cache, k_scale, v_scale, table, slot_pos, q_pos, out, lse, o_part,
            m_part, l_part, s_lens,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *sc_strides,
            *table.stride(), *slot_pos.stride(), *q_pos.stride(), *out.stride(),
            scale_log2, win, tq, s_len, hkv, tiles_per_split,
            G=g, BS=bs, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            HAS_WINDOW=window is not None, SPLIT=splits > 1, STORE_LSE=return_probs,
            PRECISION=precision, QUANT=mode, GS=gs, DYN_S=slot_count is not None, **launch,
        )
    if splits > 1:
        _combine_kernel[(m_tiles, b * hkv)](
            o_part, m_part, l_part, out, lse, *out.stride(), tq, hkv, splits,
            G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m, STORE_LSE=return_probs, num_warps=4,
        )
    if return_probs:
        block_t = min(_pow2(tq), 32)
        _probs_kernel[(n_tiles, b if sum_heads else b * hkv, triton.cdiv(tq, block_t))](
            q, k_cache, k_scale, table, slot_pos, q_pos, lse, probs,
            *q.stride(), *k_cache.stride(), *sc_strides,
            *table.stride(), *slot_pos.stride(), *q_pos.stride(),
            q_pos if slot_count is None else slot_count,  # SLEN, ROWS: unread if None
            q_pos if mass_rows is None else mass_rows, scale_log2, win, tq, s_len, hkv,
            G=g, BS=bs, D=d, BLOCK_D=block_d, BLOCK_T=block_t, BLOCK_N=block_n,
            HAS_WINDOW=window is not None, PRECISION=precision, QUANT=mode, GS=gs,
            SUM_KV=sum_heads, DYN_S=slot_count is not None, HAS_ROWS=mass_rows is not None,
            num_warps=4,
        )
    return out, probs


def select_attention(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The attention function for tensors on `device`: Triton on CUDA; on CPU the C++
    decode kernel when it builds (kvpool/cpu_attention.py), else the torch path."""
    if device.type == "cuda" and triton is not None:
        return paged_attention_triton
    if device.type == "cpu" and kernel_available():
        return paged_attention_cpu
    return paged_attention
