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
    """
    b, tq, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    if quant is not None:
        wide = torch.float32 if return_probs else q.dtype
        k = gather_dequant(k_cache, quant.k_scale, table, quant.fmt, wide)
        v = gather_dequant(v_cache, quant.v_scale, table, quant.fmt, wide)
    else:
        k = gather_blocks(k_cache, table)  # [B, S, Hkv, D]
        v = gather_blocks(v_cache, table)
    mask = visible_mask(slot_pos, q_pos, window)  # [B, Tq, S]
    if not return_probs:  # SDPA wants one dtype; no copy when the pool's is q's
        k, v = k.to(q.dtype), v.to(q.dtype)
    if not return_probs and tq == 1 and g > 1:
        # Decode under GQA: the G query heads of a kv head become G query rows against
        # that head's keys (same mask). CPU SDPA runs this ~2x faster than enable_gqa.
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, g, d), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None], scale=scale,
        )
        return out.reshape(b, 1, hq, d), None
    if not return_probs:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None], scale=scale, enable_gqa=g > 1,
        )
        return out.transpose(1, 2), None
    # Explicit softmax: the probabilities are the statistic some policies need.
    qf = q.float().view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    kf = k.float().permute(0, 2, 3, 1)  # [B, Hkv, D, S]
    scores = torch.matmul(qf, kf) * scale  # [B, Hkv, G*Tq, S]
    scores = scores.view(b, hkv, g, tq, -1).masked_fill_(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # [B, Hkv, G, Tq, S]
    vf = v.float().transpose(1, 2)  # [B, Hkv, S, D]
    out = torch.matmul(probs.view(b, hkv, g * tq, -1), vf)  # [B, Hkv, G*Tq, D]
    out = out.view(b, hkv, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d)
    mass = probs.sum(dim=2).transpose(1, 2)  # [B, Tq, Hkv, S]
    return out.to(q.dtype), mass


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt chunk with nothing cached before it attends only to its own keys:
    q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] by plain causal SDPA (the fused kernel,
    no block gather, no [T, S] mask). About half of a 3M model's prefill time went to
    gathering and masking before this existed. k/v in another dtype (read back from a
    narrower pool) are cast to q's, as in `paged_attention`. Into `out` when given."""
    g = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    # 4-D inputs: with 3-D ones CPU SDPA leaves its fused kernel (~3x slower).
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True,
                                       scale=scale, enable_gqa=g > 1)[0].transpose(0, 1)
    return o if out is None else out.copy_(o)

