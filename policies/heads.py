"""How a request's policy keeps tokens across the kv heads of a layer (`kv_policy`'s
`heads`), over a per-head pool (`--kv-layout head`), where each (layer, kv head) is a
row of the policy's view with its own slots and statistics:

- `uniform` (a per-head pool's default): every head ranks its own tokens by its own
  scores and keeps the policy's budget (kvpress's per-head presses);
- `adaptive`: AdaKV (arXiv 2407.11550; kvpress `AdaKVPress`): a layer's budget, the
  sum of its heads', goes to the highest scores among all its heads, so a head whose
  attention is spread keeps more than one that looks at a few tokens; each head keeps
  at least `ALPHA` of its own budget (the paper's safeguard, kvpress's alpha_safeguard);
- `shared` (a per-layer pool's only mode): one set a layer, every head scored by the
  layer's statistics (kvpool/head_stats.py), as a per-layer pool keeps it.

`adaptive_drops` turns a step's per-row drop counts into AdaKV's: the same total a
layer, spread by score. The policy then drops each row's lowest as it always does.
"""

from __future__ import annotations

from array import array

import torch

from policies.base import NATIVE

HEADS = ("uniform", "adaptive", "shared")
ALPHA = 0.2  # AdaKV's safeguard: the share of its budget a head always keeps
# Up to this many of a row a top-k finds the k-th value; past it a sort of the values does.
_TOPK_MAX = 256


def _candidates(live: torch.Tensor, first: list[int], last: list[int]) -> torch.Tensor:
    """[N, W] bool: live slots outside each row's first `first` and last `last` live."""
    n = live.shape[0]
    cand = live
    if any(first):
        cand = cand & (live.cumsum(dim=1) > torch.tensor(first).view(n, 1))
    if any(last):
        cand = cand & (live.flip(1).cumsum(dim=1).flip(1) > torch.tensor(last).view(n, 1))
    return cand


def _kth_largest(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[M, X] values (no NaN), [M, 1] k >= 1 -> [M, 1]: each row's k-th largest (its
    smallest past k >= X). A top-k of the largest k where that is short (a decode
    step's few drops, the safeguard's fifth of a budget), else a sort of the values."""
    x = v.shape[1]
    kmax = min(int(k.max()), x)
    vals = (v.topk(kmax, dim=1).values if kmax <= _TOPK_MAX
            else v.sort(dim=1, descending=True).values)
    return vals.gather(1, k.clamp(max=kmax) - 1)


def _first_by_score(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[M, X] bool: the first k[i] of row i (k [M, 1] >= 0) in a stable descending sort
    of `v` (no NaN): all above the k-th largest, and of those equal to it the ones at
    the lowest indices, as many as fit."""
    kth = _kth_largest(v, k.clamp(min=1))
    above = v > kth
    tied = v == kth
    room = k - above.sum(dim=1, keepdim=True)
    # the common case: no row has more ties at its threshold than room, so all fit
    if bool((tied.sum(dim=1, keepdim=True) > room).any()):
        tied &= tied.cumsum(dim=1) <= room
    return (above | tied) & (k > 0)


def adaptive_drops(scores: torch.Tensor, live: torch.Tensor, lengths: list[int],
                   keep: list[int], heads: int, requests: int,
                   first: list[int] | int = 0, last: list[int] | int = 0,
                   divisor: torch.Tensor | None = None) -> list[int]:
    """AdaKV's drop count for every row (rows (l·H + h)·R + r, [N, W] `scores` and
    `live`; `lengths` and `keep`, its budget, per row): each (layer, request) keeps the
    sum of its heads' budgets, so it drops what its heads hold beyond it (a head under
    its budget leaves room for another over it), its lowest scores among all its heads'
    candidates (live slots past the first `first` and last `last` of their row), less
    each head's top ALPHA × (its budget), those first and last included, that stays
    whatever the others score. `divisor` [N]: rank scores / divisor, as `drop_lowest`
    does.

    Order, as stable sorts give it: a head's top goes to the higher score, the lower
    slot among equals; the layer's drops to the lower score, the lower head then slot
    among equals; a NaN sorts above every number and is never dropped here. Each is a
    threshold (the k-th value: a top-k) and a count of ties, not a sort of every row
    (`_sorted_drops`, which a NaN takes). On CPU a C++ pass reads each (layer, request)'s
    rows once instead (policies/csrc/adaptive.h), the same counts."""
    n, w = live.shape
    f = first if isinstance(first, list) else [first] * n
    t = last if isinstance(last, list) else [last] * n
    if (NATIVE["select"] and scores.device.type == "cpu" and live.dtype == torch.bool
            and (divisor is None or divisor.dtype == torch.float32)):
        # the four per-row counts as one host-made tensor; [L, R, W] scores read in place
        counts = torch.frombuffer(array("q", [*f, *t, *(x - k for x, k in zip(lengths, keep)),
                                              *(int(k * ALPHA) for k in keep)]),
                                  dtype=torch.int64).view(4, n)
        if scores.dim() not in (2, 3):
            scores = scores.reshape(n, w)
        return torch.ops.kvserve_policies.adaptive_drops(
            scores.float(), live.reshape(n, w), counts, heads, requests, divisor).tolist()
    lanes = n // requests
    over = torch.tensor(lengths) - torch.tensor(keep)
    total = over.view(lanes // heads, heads, requests).sum(dim=1).clamp(min=0).view(-1, 1)
    if not bool(total.any()):
        return [0] * n
    s = scores.reshape(n, w).float()
    if divisor is not None:
        s = s / divisor.view(n, 1)
    live = live.reshape(n, w)
    cand = _candidates(live, f, t)
    # AdaKV's safeguard counts the row's sinks and window (kvpress scores them above
    # every other token, so they are its top): only the rest of it is taken here
    forced = (live.sum(dim=1) - cand.sum(dim=1)).view(n, 1)
    safe = (torch.tensor([int(k * ALPHA) for k in keep]).view(n, 1) - forced).clamp(min=0)
    if bool(s.isnan().any()):
        return _sorted_drops(s, cand, safe, total, heads, requests)
    # each row's top `safe` candidates are kept whatever the others score
    pool = cand & ~_first_by_score(s.masked_fill(~cand, float("-inf")), safe)
    # a layer's heads side by side: [L·R groups, H·W], and its total drop: the lowest
    # `total`, negated into the first `total` of a descending order (ties to the lower
    # index either way); -inf scores take their place in it but are never dropped
    groups = lanes // heads
    grouped = s.masked_fill(~pool, float("inf")).view(groups, heads, requests, w)
    grouped = grouped.transpose(1, 2).reshape(-1, heads * w)
    neg = grouped.neg()
    kth = _kth_largest(neg, total.clamp(min=1))
    below = (neg > kth) & grouped.isfinite()
    tied = (neg == kth) & grouped.isfinite()
    # per (group, head): the drops below the threshold, then the ties the group's room
    # leaves, handed to its heads in order (a head's ties all sit before the next's)
    below_h = below.view(-1, heads, w).sum(dim=2)
    tied_h = tied.view(-1, heads, w).sum(dim=2)
    room = total - (neg > kth).sum(dim=1, keepdim=True)
    before = tied_h.cumsum(dim=1) - tied_h
    taken = (room - before).clamp(min=0).minimum(tied_h)
    counts = (below_h + taken) * (total > 0)
    return counts.view(groups, requests, heads).transpose(1, 2).reshape(-1).tolist()


def _sorted_drops(s: torch.Tensor, cand: torch.Tensor, safe: torch.Tensor,
                  total: torch.Tensor, heads: int, requests: int) -> list[int]:
    """`adaptive_drops` by full stable sorts: scores with a NaN (TOVA's 0/0), whose
    place in a sort the thresholds' comparisons cannot see."""
    n, w = s.shape
    lanes = n // requests
    order = s.masked_fill(~cand, float("-inf")).argsort(dim=1, descending=True, stable=True)
    top = torch.zeros_like(cand).scatter_(1, order, torch.arange(w).expand(n, w) < safe)
    pool = cand & ~top
    grouped = s.masked_fill(~pool, float("inf")).view(lanes // heads, heads, requests, w)
    grouped = grouped.transpose(1, 2).reshape(-1, heads * w)
    rank = grouped.argsort(dim=1, stable=True).argsort(dim=1)
    chosen = (rank < total) & grouped.isfinite()
    counts = chosen.view(lanes // heads, requests, heads, w).sum(dim=3).transpose(1, 2)
    return counts.reshape(-1).tolist()
