"""Attention over the paged pool: the torch path (CPU, and the reference for Triton).

One call attends a *group* of sequences at once: the decode group (one query each) or
the prefill group (chunks padded to the longest). Keys are never gathered per sequence
in Python; the block tables are a tensor and one `index_select` fetches every block.

Which cached slot a query may see is decided by positions alone, because eviction
makes the slot order meaningless:
    visible(q, s) = slot_pos[s] >= 0                # slot filled and not evicted
                    and slot_pos[s] <= q_pos         # causal (the chunk's own keys are
                                                     # written before attention runs)
                    and slot_pos[s] > q_pos - window # sliding-window models only
This is also what lets prefill chunks attend to earlier cached blocks for free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.quant import QuantCache, gather_dequant

# Position given to padded query rows. Their output is discarded by the caller; a row
# that sees no slot (possible for padding under a sliding window) yields zeros.
PAD_QUERY_POS = 2**30
# The explicit softmax (soft-capping, sinks, the mass policies read) holds [Hq, rows,
# keys] fp32 scores a block of query rows at a time: 16 Mi elements (64 MiB) at most.
_EXPLICIT_ELEMS = 1 << 24


def visible_mask(slot_pos: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, Tq, S] bool mask from slot positions [B, S] and query positions [B, Tq]."""
    sp = slot_pos[:, None, :]
    qp = q_pos[:, :, None]
    mask = (sp >= 0) & (sp <= qp)
    if window is not None:
        mask &= sp > qp - window
    return mask


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, H, D] × [B, NB] block ids (-1 = none) -> [B, NB*bs, H, D]."""
    b, nb = table.shape
    out = cache.index_select(0, table.clamp(min=0).reshape(-1))
    return out.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def paged_attention(
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attend padded queries to their sequences' cached slots.

    q: [B, Tq, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    table: [B, NB] int64 block ids (-1 pads); slot_pos: [B, NB*block_size] int
    (original token position of each slot, -1 when empty or evicted);
    q_pos: [B, Tq] (PAD_QUERY_POS for padding rows).

    The caches may hold another floating dtype than q: a pool narrower than the model
    (`kv_cache_dtype`, e.g. bf16 under an fp32 model) halves the bytes decode reads. The
    gathered keys and values are cast to q's dtype (the gather copies anyway), so a
    narrow pool rounds what is stored but never the maths: that runs in q's dtype (SDPA)
    or in fp32 (`return_probs`). A quantized pool (`quant`: int8, fp8, int4 codes with
    their scales) has only the gathered blocks dequantized, to q's dtype (fp32 for
    `return_probs`).

    Returns out [B, Tq, Hq, D] in q's dtype and, when `return_probs`, the attention
    probability of every slot summed over the query heads of its kv group:
    [B, Tq, Hkv, NB*block_size] float32 (zero on invisible slots). Eviction policies
    aggregate it over queries themselves (H2O sums, SnapKV pools a window).

    The model's attention variants (`softmax_logits` says what they do; every kernel
    takes the same two): `softcap` (Gemma 2) and `sinks` [Hq] or [B, Hq] float32, a
    learned logit per query head (gpt-oss) that joins each softmax with no value. Either
    takes the explicit softmax in fp32 (SDPA has neither); with sinks the mass is the
    real softmax's, the sink's share left out.
    """
    b, tq, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    explicit = return_probs or softcap is not None or sinks is not None
    if quant is not None:
        wide = torch.float32 if explicit else q.dtype
        k = gather_dequant(k_cache, quant.k_scale, table, quant.fmt, wide)
        v = gather_dequant(v_cache, quant.v_scale, table, quant.fmt, wide)
    else:
        k = gather_blocks(k_cache, table)  # [B, S, Hkv, D]
        v = gather_blocks(v_cache, table)
    mask = visible_mask(slot_pos, q_pos, window)  # [B, Tq, S]
    if explicit:
        return _explicit_by_rows(q, k, v, mask, scale, softcap, sinks, return_probs)
    k, v = k.to(q.dtype), v.to(q.dtype)  # SDPA wants one dtype; no copy when the pool's is q's
    if tq == 1 and g > 1:
        # Decode under GQA: the G query heads of a kv head become G query rows against
        # that head's keys (same mask). CPU SDPA runs this ~2x faster than enable_gqa.
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, g, d), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None], scale=scale,
        )
        return out.reshape(b, 1, hq, d), None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=g > 1,
    )
    return out.transpose(1, 2), None


def softmax_logits(scores: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """q·k products -> the logits the softmax takes: scaled, then soft-capped where the
    model does (Gemma 2: cap * tanh(x / cap), in transformers' order: scale, divide,
    tanh, multiply; before the mask)."""
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax written out in fp32: q [B, Tq, Hq, D], k/v [B, S, Hkv, D], mask
    [B, Tq, S] -> (out [B, Tq, Hq, D] in q's dtype, mass [B, Tq, Hkv, S] float32: each
    slot's probability summed over its kv group's query heads, 0 where invisible).

    `sinks` ([Hq] or [B, Hq]): gpt-oss's learned sink, an extra logit per query head
    in each softmax with no value (transformers' GptOssAttention): a token's probability
    is what the model gave it, and the sink takes the rest. A row that sees no slot
    gives zeros, with or without."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qf = q.float().view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    kf = k.float().permute(0, 2, 3, 1)  # [B, Hkv, D, S]
    scores = softmax_logits(torch.matmul(qf, kf), scale, softcap)  # [B, Hkv, G*Tq, S]
    scores = scores.view(b, hkv, g, tq, -1).masked_fill_(~mask[:, None, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # [B, Hkv, G, Tq, S]
    else:
        sink = sinks.float().reshape(-1, hkv, g, 1, 1).expand(b, hkv, g, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    vf = v.float().transpose(1, 2)  # [B, Hkv, S, D]
    out = torch.matmul(probs.reshape(b, hkv, g * tq, -1), vf)  # [B, Hkv, G*Tq, D]
    out = out.view(b, hkv, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d)
    mass = probs.sum(dim=2).transpose(1, 2)  # [B, Tq, Hkv, S]
    return out.to(q.dtype), mass


def _explicit_by_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float | None, sinks: torch.Tensor | None,
                      return_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`explicit_attention` a block of query rows at a time, so that one block's scores
    ([B, Hq, rows, S] float32, and the softmax's copies of them) stay within
    `_EXPLICIT_ELEMS`: a prompt chunk of 2,048 tokens against 8k slots of a 32-head
    model would otherwise hold 2 GiB of scores at once, memory no activation reserve
    counts. Rows are independent, so the blocks give the rows' own results."""
    b, tq, hq, _ = q.shape
    step = max(1, _EXPLICIT_ELEMS // max(1, b * hq * k.shape[1]))
    if step >= tq:
        out, mass = explicit_attention(q, k, v, mask, scale, softcap, sinks)
        return out, (mass if return_probs else None)
    out = torch.empty_like(q)
    mass = (torch.empty(b, tq, k.shape[2], k.shape[1], dtype=torch.float32, device=q.device)
            if return_probs else None)
    for a in range(0, tq, step):
        o, m = explicit_attention(q[:, a : a + step], k, v, mask[:, a : a + step], scale,
                                  softcap, sinks)
        out[:, a : a + step] = o
        if mass is not None:
            mass[:, a : a + step] = m
    return out, mass


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float, out: torch.Tensor | None = None,
                          softcap: float | None = None,
                          sinks: torch.Tensor | None = None,
                          window: int | None = None) -> torch.Tensor:
    """A prompt chunk with nothing cached before it attends only to its own keys:
    q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] by plain causal SDPA (the fused kernel,
    no block gather, no [T, S] mask). About half of a 3M model's prefill time went to
    gathering and masking before this existed. k/v in another dtype (read back from a
    narrower pool) are cast to q's, as in `paged_attention`. Into `out` when given.
    `softcap` / `sinks` ([Hq]): `paged_attention`'s, by the explicit softmax, a block of
    queries at a time (its scores are [Hq, rows, keys]).

    `window` (a sliding-window layer's, `visible_mask`'s rule: query i sees keys i-w+1..i):
    where it is shorter than the chunk, blocks of queries each over the keys their windows
    reach, under a band mask, so a windowed layer's first chunk takes this path as a
    global layer's does instead of the paged path's block gather and [T, S] mask (Gemma
    3's five local layers in six: every prompt longer than its window went there)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    t = q.shape[0]
    banded = window is not None and window < t
    if softcap is not None or sinks is not None or banded:
        o = torch.empty_like(q) if out is None else out
        pos = torch.arange(t, device=q.device)
        explicit = softcap is not None or sinks is not None
        # explicit: at most _EXPLICIT_ELEMS scores a block; SDPA: blocks of the window's
        # size, so a block's keys are at most twice its queries
        step = (max(1, _EXPLICIT_ELEMS // max(1, t * q.shape[1])) if explicit
                else max(window or t, 256))
        for a in range(0, t, step):
            e = min(t, a + step)  # queries a..e-1 see keys lo..e-1
            lo = max(0, a - window + 1) if banded else 0
            kp, qp = pos[None, lo:e], pos[a:e, None]
            mask = (kp <= qp) & (kp > qp - window) if banded else kp <= qp
            if explicit:
                o[a:e] = explicit_attention(q[None, a:e], k[None, lo:e], v[None, lo:e],
                                            mask[None], scale, softcap, sinks)[0][0]
            else:
                o[a:e] = F.scaled_dot_product_attention(
                    q[a:e].transpose(0, 1)[None], k[lo:e].transpose(0, 1)[None],
                    v[lo:e].transpose(0, 1)[None], attn_mask=mask, scale=scale,
                    enable_gqa=g > 1)[0].transpose(0, 1)
        return o
    # 4-D inputs: with 3-D ones CPU SDPA leaves its fused kernel (~3x slower).
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True,
                                       scale=scale, enable_gqa=g > 1)[0].transpose(0, 1)
    return o if out is None else out.copy_(o)
