"""Carrying out a request's `kv_policy` after a step.

The policy decides; this module is the only place that turns the pool's state into what
a policy sees (`StepView`: live positions and the statistics it declared) and turns its
answer (positions to drop, per layer) back into pool operations: dead slots, freed
blocks, optional compaction, and re-numbered positions with re-rotated keys for
`rope: "shift"`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.seq_cache import SeqCache
from policies.base import Eviction, LayerView, Needs, StepView

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Applied:
    evicted_slots: int = 0  # over all layers
    freed_blocks: int = 0


def build_view(cache: SeqCache, needs: Needs, attention: list[torch.Tensor] | None,
               seq_len: int, prompt_len: int, num_new: int, prefill_done: bool) -> StepView:
    pool = cache.pool
    k_flat = pool.k_cache.view(-1, *pool.k_cache.shape[2:])
    v_flat = pool.v_cache.view(-1, *pool.v_cache.shape[2:])
    layers = []
    live = cache.slot_pos >= 0
    for layer in range(cache.num_layers):
        idx = live[layer].nonzero().squeeze(1)
        lv = LayerView(positions=cache.slot_pos[layer, idx])
        if needs.key_norm or needs.keys or needs.value_norm:
            phys = cache.table[layer, idx // cache.bs] * cache.bs + idx % cache.bs
        if needs.attention and attention is not None:
            lv.attention = attention[layer][:, :, idx]
        if needs.key_norm or needs.keys:
            k = k_flat[phys.to(k_flat.device)].float().cpu()
            lv.key_norm = k.norm(dim=-1) if needs.key_norm else None
            lv.keys = k if needs.keys else None
        if needs.value_norm:
            lv.value_norm = v_flat[phys.to(v_flat.device)].float().norm(dim=-1).cpu()
        layers.append(lv)
    return StepView(seq_len=seq_len, prompt_len=prompt_len, num_new=num_new,
                    prefill_done=prefill_done, block_size=cache.bs, layers=layers)


def apply_eviction(cache: SeqCache, plan: Eviction, *, compact: bool = False,
                   rotate: Rotate | None = None) -> Applied:
    """Drop the planned positions; blocks left without a live slot return to the pool
    at once. `compact` then packs partly-dead blocks; `rotate` (RoPE shift) re-numbers
    the survivors 0..n-1 and re-rotates their keys."""
    out = Applied()
    plan = {layer: p for layer, p in plan.items() if p.numel()}
    if not plan:
        return out
    first = next(iter(plan.values()))
    pos = cache.slot_pos
    if len(plan) == cache.num_layers and all(p is first or torch.equal(p, first) for p in plan.values()):
        dead = torch.isin(pos, first)  # the same positions in every layer: one op
    else:
        dead = torch.zeros_like(pos, dtype=torch.bool)
        for layer, positions in plan.items():
            dead[layer] = torch.isin(pos[layer], positions)
    before = cache.live
    out.freed_blocks += cache.evict_mask(dead)
    out.evicted_slots += before - cache.live
    for layer in plan:
        if compact:
            out.freed_blocks += cache.compact(layer)
        if rotate is not None:
            cache.renumber(layer, rotate)
    return out
