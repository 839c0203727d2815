"""Synthetic `StepView`s and a tiny engine stand-in for the pure policy tests.

`step(policy, view)` runs a policy on one request's per-layer view the way the engine
does (`kvpool/policy_rows.py`): as a batch of one `RowsView` (layers as rows, their
live tokens as slots), with the policy's per-slot state kept by position between calls
as `SlotTables` keeps it by slot, and answers with the plan as positions per layer.

`Sim` plays the engine's part for one request: it appends positions, builds the view a
policy asked for (attention mass summed per kv group, norms, keys from fixed random
tensors, keydiff's scores of those keys as the engine's torch form computes them), checks the plan names live positions only, and carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from policies.base import StepView
from policies.norms import keydiff_scores
from policies.rows import RowsView

# A plan as positions to drop: layer -> positions (int64)
Eviction = dict[int, torch.Tensor]


@dataclass
class LayerView:
    """One layer's live tokens (ascending positions) and statistics, the tests' input."""

    positions: torch.Tensor  # [n] int64
    attention: torch.Tensor | None = None  # [Tq, Hkv, n] float32
    key_norm: torch.Tensor | None = None  # [n, Hkv]
    value_norm: torch.Tensor | None = None  # [n, Hkv]
    keys: torch.Tensor | None = None  # [n, Hkv, D]
    key_diversity: torch.Tensor | None = None  # [n]
    new_key_norm: torch.Tensor | None = None  # [num_new, Hkv]: the newest tokens'
    new_value_norm: torch.Tensor | None = None  # [num_new, Hkv]


@dataclass
class LayersView(StepView):
    """A `StepView` with every layer's tokens: what `run_step` turns into a RowsView."""

    layers: list[LayerView] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lengths and self.layers:
            self.lengths = [lv.positions.numel() for lv in self.layers]


def _pad(parts: list[torch.Tensor], width: int, dim: int) -> torch.Tensor:
    """Stack per-layer tensors, zero-padded to `width` along `dim` (the token dim)."""
    out = []
    for t in parts:
        pad = [0, 0] * (t.dim() - 1 - dim) + [0, width - t.shape[dim]]
        out.append(torch.nn.functional.pad(t, pad))
    return torch.stack(out)


def run_step(policy, v: LayersView) -> Eviction:
    """Run `policy` on `v` as the engine does; the plan as {layer: positions}."""
    layers = v.layers
    nl = len(layers)
    width = max(lv.positions.numel() for lv in layers)
    positions = torch.stack([torch.nn.functional.pad(lv.positions, (0, width - lv.positions.numel()),
                                                     value=-1) for lv in layers])
    rv = RowsView(num_layers=nl, num_new=v.num_new, seq_len=[v.seq_len],
                  prompt_len=[v.prompt_len], prefill_done=[v.prefill_done],
                  lengths=[lv.positions.numel() for lv in layers], slot_pos=positions,
                  block_size=v.block_size)
    fills = getattr(policy, "state", {})
    # per layer (positions, {state name: values}), as the tables would hold them
    held = policy.__dict__.setdefault("_slot_state", {})
    for name, spec in fills.items():  # each token's state, as the tables keep it
        fill, k = spec if isinstance(spec, tuple) else (spec, 0)
        rows = torch.full((nl, width, k) if k else (nl, width), fill, dtype=torch.float32)
        for layer, lv in enumerate(layers):
            old_pos, old = held.get(layer, (torch.empty(0, dtype=torch.int64), {}))
            if name in old and old_pos.numel():
                hit = torch.isin(lv.positions, old_pos)
                idx = torch.searchsorted(old_pos, lv.positions[hit])
                rows[layer, : lv.positions.numel()][hit] = old[name][idx]
        rv.state[name] = rows
    first = layers[0]
    if first.attention is not None:
        rv.attention = _pad([lv.attention for lv in layers], width, 2)
    for name in ("key_norm", "value_norm", "keys", "key_diversity"):
        if getattr(first, name) is not None:
            setattr(rv, name, _pad([getattr(lv, name) for lv in layers], width, 0))
    if policy.needs.key_diversity and rv.key_diversity is None and rv.keys is not None:
        rv.key_diversity = keydiff_scores(rv.keys, rv.live)  # the engine's torch form
    for name in ("new_key_norm", "new_value_norm"):
        if getattr(first, name) is not None:
            k = getattr(first, name).shape[0]
            rv.new_slots = torch.tensor(rv.lengths)[:, None] - k + torch.arange(k)
            setattr(rv, name, torch.stack([getattr(lv, name) for lv in layers]))
    drop = type(policy).select([policy], rv)
    plan: Eviction = {}
    for layer, lv in enumerate(layers):
        n = lv.positions.numel()
        gone = drop[layer, :n] if drop is not None else torch.zeros(n, dtype=torch.bool)
        if bool(gone.any()):
            plan[layer] = lv.positions[gone]
        held[layer] = (lv.positions[~gone], {name: t[layer, :n][~gone] for name, t in rv.state.items()})
    return plan


def view(layers: list[LayerView], seq_len: int, prompt_len: int, num_new: int = 1,
         prefill_done: bool = False, block_size: int = 4) -> LayersView:
    return LayersView(seq_len=seq_len, prompt_len=prompt_len, num_new=num_new,
                    prefill_done=prefill_done, block_size=block_size, layers=layers)


def arange(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64)


def causal_probs(logits: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Softmax over keys of [Tq, H, n] logits with a causal mask (key pos <= query pos)."""
    mask = kpos[None, None, :] <= qpos[:, None, None]
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def group_sum(probs: torch.Tensor, hkv: int) -> torch.Tensor:
    """[Tq, H, n] per query head -> [Tq, Hkv, n] summed over each kv group (the view)."""
    tq, h, n = probs.shape
    return probs.view(tq, hkv, h // hkv, n).sum(dim=2)


class Sim:
    def __init__(self, policy, num_layers: int = 3, hkv: int = 2, group: int = 2,
                 dim: int = 8, block_size: int = 4, max_len: int = 4096, seed: int = 0,
                 skip_idle: bool = False):
        """`skip_idle`: as the engine, skip the policy on steps its `idle` declines."""
        self.policy = policy
        self.skip_idle, self.skipped = skip_idle, 0
        self.num_layers, self.hkv, self.group, self.block_size = num_layers, hkv, group, block_size
        self.gen = torch.Generator().manual_seed(seed)
        shape = (num_layers, max_len, hkv, dim)
        self.keys = torch.randn(shape, generator=self.gen) * (1 + torch.rand(
            (num_layers, max_len, hkv, 1), generator=self.gen))
        self.values = torch.randn(shape, generator=self.gen)
        self.live = [arange(0) for _ in range(num_layers)]
        self.seq_len = 0
        self.prefill_seen = False

    def step(self, num_new: int, prompt_len: int) -> dict[int, torch.Tensor]:
        new = torch.arange(self.seq_len, self.seq_len + num_new)
        self.seq_len += num_new
        done = not self.prefill_seen and self.seq_len >= prompt_len
        self.prefill_seen |= done
        needs = self.policy.needs
        layers = []
        for layer in range(self.num_layers):
            pos = torch.cat([self.live[layer], new])
            self.live[layer] = pos
            lv = LayerView(positions=pos)
            if needs.attention:
                h = self.hkv * self.group
                logits = torch.randn((num_new, h, pos.numel()), generator=self.gen) * 2
                logits[:, :, pos == 0] += 4.0  # a sink, as real models have
                probs = causal_probs(logits, new, pos)
                lv.attention = group_sum(probs, self.hkv)
            k, v = self.keys[layer, pos], self.values[layer, pos]
            if needs.key_norm:
                lv.key_norm = k.norm(dim=-1)
            if needs.new_key_norm:
                lv.new_key_norm = self.keys[layer, new].norm(dim=-1)
            if needs.new_value_norm:
                lv.new_value_norm = self.values[layer, new].norm(dim=-1)
            if needs.value_norm:
                lv.value_norm = v.norm(dim=-1)
            if needs.keys or needs.key_diversity:  # run_step scores them
                lv.keys = k
            layers.append(lv)
        v = view(layers, self.seq_len, prompt_len, num_new, done, self.block_size)
        idle = getattr(self.policy, "idle", None)
        if self.skip_idle and idle is not None and idle(v):
            self.skipped += 1
            return {}
        plan = run_step(self.policy, v)
        for layer, drop in plan.items():
            live = self.live[layer]
            assert drop.dtype == torch.int64
            assert drop.unique().numel() == drop.numel(), "duplicate positions in a plan"
            assert bool(torch.isin(drop, live).all()), "plan names a dead position"
            self.live[layer] = live[~torch.isin(live, drop)]
        return plan

    def counts(self) -> list[int]:
        return [p.numel() for p in self.live]


def slot_state(policy, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept positions, their per-slot `name` state) after the last `run_step`."""
    pos, state = policy.__dict__["_slot_state"][layer]
    return pos, state[name]


def evict_positions(cache, plan: Eviction, compact: bool = False, rotate=None) -> tuple[int, int]:
    """Carry out a plan given as positions per layer on a cache, the way the engine
    carries out a policy's drop mask (`kvpool/policy_rows.py::carry_out`); returns
    (slots evicted over all layers, blocks freed)."""
    from kvpool.policy_rows import carry_out

    width = max(cache.nblocks, default=0) * cache.bs
    pos = cache.slot_pos[:, :width]
    dead = torch.zeros(pos.shape, dtype=torch.bool)
    for layer, drop in plan.items():
        dead[layer] = torch.isin(pos[layer], drop) & (pos[layer] >= 0)
    return carry_out([cache], dead[:, None], [compact], [rotate])[0]
