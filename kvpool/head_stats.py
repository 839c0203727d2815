"""The statistics a policy's view carries over a per-head pool when the request keeps
one set of tokens a layer (`"heads": "shared"`).

Over a per-head pool (`--kv-layout head`) every (layer, kv head) is a lane of the tables
with its own slots, and the runner hands each lane its own head's statistics (Hkv = 1).
A shared request's lanes of a layer hold the same tokens in the same logical slots, so
its view gives every lane the layer's statistics exactly as a per-layer pool gives them:
the heads' values side by side where a per-layer view has a head axis (key and value
norms, keys, the mass a policy reads per head, the prompt's query sums), summed over the
heads where it has the sum (`head_sum`, the same order), averaged for KeyDiff's score
(its mean over heads). Every lane then scores, ranks and drops alike, and keeps the set
a per-layer pool keeps.
"""

from __future__ import annotations

import torch

from policies.rows import RowsView


def head_sum(mass: torch.Tensor) -> torch.Tensor:
    """[L, r, Tq, Hkv, W] -> [L, r, Tq, 1, W] summed over the kv heads. Up to 4 heads as
    one add per head in head order: the order torch's sum over a non-inner dim takes
    there (the same bits, tests/test_policy_state.py; from 8 on it accumulates in
    another order, so it sums), twice as fast on the slice of the runner's mass (a
    strided reduction over a dim of 2 was 0.15 ms a step at 16 requests of ~1k tokens)."""
    if not 2 <= mass.shape[3] <= 4:
        return mass.sum(dim=3, keepdim=True)
    out = mass.narrow(3, 0, 1) + mass.narrow(3, 1, 1)
    for h in range(2, mass.shape[3]):
        out += mass.narrow(3, h, 1)
    return out


def side_by_side(t: torch.Tensor, heads: int, requests: int, axis: int) -> torch.Tensor:
    """Rows (l·H + h)·R + r of a per-lane statistic whose head axis `axis` has size 1 ->
    the same rows, each holding its layer's H heads on that axis (lane h's at h)."""
    lanes = t.shape[0] // requests
    x = t.view(lanes // heads, heads, requests, *t.shape[1:]).squeeze(axis + 2)
    y = x.movedim(1, axis + 1)  # [L, R, ..., H, ...]
    return y.unsqueeze(1).expand(y.shape[0], heads, *y.shape[1:]).reshape(
        t.shape[0], *y.shape[2:])


def share_heads(view: RowsView, attention_heads: bool) -> None:
    """Give every lane of `view` (a shared request's, over a per-head pool) its layer's
    statistics, in place (see the module docstring). `attention_heads`: the policy reads
    the mass per kv head (`Needs.attention_heads`); else its sum over them."""
    h, r = view.heads, view.num_requests
    if view.attention is not None:
        att = side_by_side(view.attention, h, r, 2)  # [N, Tq, H, W]
        view.attention = att if attention_heads else head_sum(att[None])[0]
    for name in ("key_norm", "value_norm", "keys", "new_key_norm", "new_value_norm"):
        t = getattr(view, name)
        if t is not None:
            setattr(view, name, side_by_side(t, h, r, 2))
    for name in ("query_sum", "query_outer"):  # [N, 1, G, ...]: the layer's kv heads
        t = getattr(view, name)
        if t is not None:
            setattr(view, name, side_by_side(t, h, r, 1))
    if view.key_diversity is not None:
        kd = view.key_diversity
        lanes = kd.shape[0] // r
        mean = kd.view(lanes // h, h, r, -1).mean(dim=1, keepdim=True)
        view.key_diversity = mean.expand(lanes // h, h, r, kd.shape[1]).reshape(kd.shape)
