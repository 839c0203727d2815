"""Carrying out a request's `kv_policy` after a step.

The policy decides; this module is the only place that turns the pool's state into what
a policy sees (`StepView`: live positions and the statistics it declared) and turns its
answer (positions to drop, per layer) back into pool operations: dead slots, freed
blocks, optional compaction, and re-numbered positions with re-rotated keys for
`rope: "shift"`.

This runs for every request with a policy on every engine step, so it is written as a
fixed number of tensor ops per request whatever the number of layers (all layers' live
slots, positions and gathered K/V in one op each) rather than a Python loop of small
ops per layer: the per-op overhead, not the arithmetic, is what a step pays here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from policies.base import Eviction, LayerView, Needs, StepView

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_LAYER_SHIFT = 40  # plan keys: layer << 40 | position (positions stay far below 2**40)


_SMALL_PLAN = 8  # up to this many positions a broadcast compare beats torch.isin's sort


def _member(values: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """torch.isin(values, test), by direct comparison when `test` is tiny (a decode
    step usually drops one token per layer)."""
    if test.numel() <= _SMALL_PLAN:
        return (values[..., None] == test).any(dim=-1)
    return torch.isin(values, test)


@dataclass
class Applied:
    evicted_slots: int = 0  # over all layers
    freed_blocks: int = 0


def gather_stats(pool: BlockPool, phys: torch.Tensor, needs: Needs) -> dict[str, torch.Tensor]:
    """The statistics `needs` declares for physical slots `phys` (`BlockPool.gather_stats`)."""
    return pool.gather_stats(phys, needs.key_norm, needs.keys, needs.value_norm)


def physical_slots(cache: SeqCache, idx: torch.Tensor) -> torch.Tensor:
    """[L, k] logical slots of each layer -> [L, k] physical slots of the pool."""
    bs = cache.bs
    return cache.table.gather(1, idx // bs) * bs + idx % bs


def step_header(cache: SeqCache, seq_len: int, prompt_len: int, num_new: int,
                prefill_done: bool) -> StepView:
    """A `StepView` without layers: the step's sizes and each layer's live count
    (`lengths`), enough for `Policy.idle` to say whether a full view is worth building.
    Plain ints (the cache counts its live slots per layer): no tensor op per request."""
    return StepView(seq_len=seq_len, prompt_len=prompt_len, num_new=num_new,
                    prefill_done=prefill_done, block_size=cache.bs,
                    lengths=list(cache.layer_live))


def fill_view(view: StepView, cache: SeqCache, needs: Needs,
              attention: torch.Tensor | list[torch.Tensor] | None) -> StepView:
    """Add every layer's live positions and the statistics `needs` declares.

    When every layer holds the same slots (no eviction yet, or position-only plans that
    are identical per layer) the layers share one positions tensor, so a policy can
    compute a position-only plan once (`is` identity) and `apply_eviction` apply it in
    one op. When every layer holds the same count, the [L, n, ...] tensors of the one
    gather are handed on as `view.stacks` for policies that select for all layers at
    once (`StepView.stacked`)."""
    sp = cache.slot_pos[:, : max(cache.next_slot, default=0)]  # the slots appended so far
    live = sp >= 0
    nl, bs, lengths = cache.num_layers, cache.bs, view.lengths
    even = len(set(lengths)) == 1
    same = cache.alike or (even and bool((sp == sp[:1]).all()))
    if same:
        idx0 = live[0].nonzero().squeeze(1)
        idx = [idx0] * nl
        positions = [sp[0].index_select(0, idx0)] * nl
        live = live[:1].expand(nl, -1)
    else:
        slot_idx = live.nonzero(as_tuple=True)[1]
        idx = list(slot_idx.split(lengths))
        flat = sp[live]
        positions = list(flat.split(lengths))
    if even and nl:
        view.stacks["positions"] = positions[0].expand(nl, -1) if same else flat.view(nl, -1)
    gathered: dict[str, torch.Tensor] = {}
    if needs.key_norm or needs.keys or needs.value_norm:
        # Physical slot of every (layer, live slot), then one gather for all layers.
        width = sp.shape[1]
        slots = (cache.table[:, : -(-width // bs), None] * bs + torch.arange(bs)).view(nl, -1)
        gathered = gather_stats(cache.pool, slots[:, :width][live], needs)
    sizes = {name: lengths for name in gathered}
    if needs.new_key_norm and nl:
        k = min(view.num_new, *lengths)  # this step's tokens: the last live slots
        last = torch.stack([i[i.numel() - k:] for i in idx])  # [L, k]
        gathered["new_key_norm"] = gather_stats(
            cache.pool, physical_slots(cache, last).view(-1), Needs(key_norm=True))["key_norm"]
        sizes["new_key_norm"] = [k] * nl
    split = {name: t.split(sizes[name]) for name, t in gathered.items()}
    if even and nl:
        view.stacks.update({name: t.view(nl, -1, *t.shape[1:]) for name, t in gathered.items()})
    layers = []
    for layer in range(nl):
        lv = LayerView(positions=positions[layer])
        if needs.attention and attention is not None:
            lv.attention = attention[layer][:, :, idx[layer]]
        for name, parts in split.items():
            setattr(lv, name, parts[layer])
        layers.append(lv)
    view.layers = layers
    return view


def build_view(cache: SeqCache, needs: Needs, attention: torch.Tensor | list[torch.Tensor] | None,
               seq_len: int, prompt_len: int, num_new: int, prefill_done: bool) -> StepView:
    return fill_view(step_header(cache, seq_len, prompt_len, num_new, prefill_done),
                     cache, needs, attention)


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
    # Only the held columns can be live (evict_mask reads this width of `dead`).
    pos = cache.slot_pos[:, : max(cache.nblocks, default=0) * cache.bs]
    sizes = {p.numel() for p in plan.values()}
    alike = False
    if len(plan) == cache.num_layers and all(p is first or torch.equal(p, first) for p in plan.values()):
        dead = _member(pos, first)  # the same positions in every layer: one op
        alike = cache.alike  # and the same slots, if they were before
    elif len(plan) == cache.num_layers and len(sizes) == 1 and first.numel() <= _SMALL_PLAN:
        # one row of drops per layer (decode of a scoring policy): compare, no isin
        dead = (pos[:, :, None] == torch.stack([plan[layer] for layer in range(cache.num_layers)])[:, None, :]).any(dim=2)
    else:  # one isin over (layer, position) keys instead of one per layer
        rows = torch.arange(cache.num_layers, dtype=torch.int64)[:, None] << _LAYER_SHIFT
        keys = torch.cat([p.to(torch.int64) + (layer << _LAYER_SHIFT) for layer, p in plan.items()])
        dead = torch.isin(pos + rows, keys)
    before = cache.live
    out.freed_blocks += cache.evict_mask(dead, alike)
    out.evicted_slots += before - cache.live
    if compact:  # every planned layer in one pass
        out.freed_blocks += cache.tables.compact(cache.pool, [cache], list(plan))[0]
    if rotate is not None:
        for layer in plan:
            cache.renumber(layer, rotate)
    return out
