"""The Triton kernels of paged attention (`attention.triton_attention` launches them):
`_decode_kernel` for one query token a row, `_attn_kernel` for prefill chunks over a
cached prefix, `_combine_kernel` merging split-KV partials, `_probs_kernel` for the
attention mass, and `_load_rows`, a tile of K or V (dequantized for a quantized pool).
Without Triton the module still imports (its kernels are then plain functions never
launched).

The attention variants (`attention.torch_attention.paged_attention` says what they are)
are compile-time flags, so a plain model's kernels are the code they were: HAS_CAP soft-
caps each tile's scores (`_soft_cap`, in the first pass and the mass pass alike) and
HAS_SINKS starts the online softmax of split 0 from the head's sink (`_sink_start`: max =
the sink, denominator 1, no value), so the merge of the splits and the row's log-sum-exp,
which the mass pass divides by, count it once."""

from __future__ import annotations

try:  # CPU installs may lack triton: they still import this module and use torch.
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

    def _jit(fn):  # type: ignore[no-redef]
        return fn


LOG2E = 1.4426950408889634


@_jit
def _load_rows(PTR, SC, blk, off, kvh, d, sn, ss, sh, sd, scn, scs, sch, scg, mask,
               QUANT: tl.constexpr, GS: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of K or V in fp32; a quantized pool's codes are decoded
    and scaled here, as they are loaded (attention/quant.py: 1 int8, 2 fp8 e4m3 read as
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
def _soft_cap(scores, cap_log2, two_over_cap):
    """Gemma 2's cap * tanh(s / cap) on scores in log2 units (s · LOG2E, as the kernels
    keep them): tanh(y) = 1 - 2 / (e^2y + 1), e^2y = exp2(2 · scores / cap); an infinite
    e^2y gives the cap, exactly. `cap_log2` = cap · LOG2E, `two_over_cap` = 2 / cap."""
    t = tl.exp2(scores * two_over_cap)
    return cap_log2 * (1.0 - 2.0 / (t + 1.0))


@_jit
def _sink_start(SINKS, b, h, ssk_b, ssk_h, ok, first):
    """(max, denominator) a row's online softmax starts from: the head's sink logit (in
    log2 units) and 1 where `first` (split 0, which alone counts it), else -inf and 0."""
    sk = tl.load(SINKS + b * ssk_b + h * ssk_h, mask=ok, other=0.0).to(tl.float32)
    use = ok & first
    return (tl.where(use, sk * 1.4426950408889634, float("-inf")),
            tl.where(use, 1.0, 0.0))


@_jit
def _attn_kernel(
    Q, K, V, KS, VS, TABLE, SLOT_POS, Q_POS, OUT, LSE, O_PART, M_PART, L_PART, SLEN, SINKS,
    sq_b, sq_t, sq_h, sq_d,
    sk_n, sk_s, sk_h, sk_d,
    sv_n, sv_s, sv_h, sv_d,
    sc_n, sc_s, sc_h, sc_g,
    st_b, st_n, ssp_b, ssp_s, sqp_b, sqp_t,
    so_b, so_t, so_h, so_d, ssk_b, ssk_h,
    scale_log2, window, Tq, S, Hkv, tiles_per_split, cap_log2, two_over_cap,
    G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr, GS: tl.constexpr, DYN_S: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
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

    if HAS_SINKS:
        m_i, l_i = _sink_start(SINKS, b, h, ssk_b, ssk_h, row_ok, pid_s == 0)
    else:
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
            if HAS_CAP:
                scores = _soft_cap(scores, cap_log2, two_over_cap)
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
    Q, K, V, KS, VS, TABLE, SLOT_POS, Q_POS, OUT, LSE, O_PART, M_PART, L_PART, SLEN, SINKS,
    sq_b, sq_h, sq_d,
    sk_n, sk_s, sk_h, sk_d,
    sv_n, sv_s, sv_h, sv_d,
    sc_n, sc_s, sc_h, sc_g,
    st_b, st_n, ssp_b, ssp_s, sqp_b,
    so_b, so_h, so_d, ssk_b, ssk_h,
    scale_log2, window, S, Hkv, tiles_per_split, cap_log2, two_over_cap,
    G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr, GS: tl.constexpr, DYN_S: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
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
    G = 4 (the H200 sweep of commit 65b60e2); its padding rows cost no memory."""
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

    if HAS_SINKS:
        m_i, l_i = _sink_start(SINKS, b, h, ssk_b, ssk_h, g_ok, pid_s == 0)
    else:
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
        if HAS_CAP:
            scores = _soft_cap(scores, cap_log2, two_over_cap)
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
    SLEN, ROWS, scale_log2, window, Tq, S, Hkv, cap_log2, two_over_cap,
    G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, QUANT: tl.constexpr, GS: tl.constexpr,
    SUM_KV: tl.constexpr, DYN_S: tl.constexpr, HAS_ROWS: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    """probs[b, t, kvh, s] = Σ_g exp2(score - lse) for one (slot tile, query tile).

    SUM_KV: one program walks every kv head of its row and writes the sum over all
    query heads, probs[b, t, 0, s] (what a policy that reads no head apart takes): the
    same sum without atomics, so the statistic stays deterministic. DYN_S: only the
    first SLEN[0] slots are read or written (a CUDA graph's tables are wider than the
    step's). HAS_ROWS: rows b with ROWS[b] == 0 want no mass and get zeros. The row's
    log-sum-exp counts a sink, so a slot's mass is its share of the real softmax."""
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
                if HAS_CAP:
                    scores = _soft_cap(scores, cap_log2, two_over_cap)
                mass += tl.where(vis, tl.exp2(scores - lse[:, None]), 0.0)
    if SUM_KV:
        row = b.to(tl.int64) * Tq + t
    else:
        row = (b.to(tl.int64) * Tq + t) * Hkv + kv_first  # int64: B*Tq*Hkv*S can pass 2**31
    tl.store(PROBS + row[:, None] * S + s[None, :], mass,
             mask=t_ok[:, None] & s_ok[None, :])
