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

import torch

HEADS = ("uniform", "adaptive", "shared")
ALPHA = 0.2  # AdaKV's safeguard: the share of its budget a head always keeps


def _candidates(live: torch.Tensor, first: list[int], last: list[int]) -> torch.Tensor:
    """[N, W] bool: live slots outside each row's first `first` and last `last` live."""
    n = live.shape[0]
    rank = live.cumsum(dim=1)
    from_end = live.flip(1).cumsum(dim=1).flip(1)
    return (live & (rank > torch.tensor(first).view(n, 1))
            & (from_end > torch.tensor(last).view(n, 1)))


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
    does."""
    n, w = live.shape
    lanes = n // requests
    over = torch.tensor(lengths) - torch.tensor(keep)
    total = over.view(lanes // heads, heads, requests).sum(dim=1).clamp(min=0).view(-1, 1)
    if not bool(total.any()):
        return [0] * n
    f = first if isinstance(first, list) else [first] * n
    t = last if isinstance(last, list) else [last] * n
    s = scores.reshape(n, w).float()
    if divisor is not None:
        s = s / divisor.view(n, 1)
    cand = _candidates(live.reshape(n, w), f, t)
    # AdaKV's safeguard counts the row's sinks and window (kvpress scores them above
    # every other token, so they are its top): only the rest of it is taken here
    forced = (live.reshape(n, w).sum(dim=1) - cand.sum(dim=1)).view(n, 1)
    safe = (torch.tensor([int(k * ALPHA) for k in keep]).view(n, 1) - forced).clamp(min=0)
    # each row's top `safe` candidates are kept whatever the others score
    order = s.masked_fill(~cand, float("-inf")).argsort(dim=1, descending=True, stable=True)
    top = torch.zeros_like(cand).scatter_(1, order, torch.arange(w).expand(n, w) < safe)
    pool = cand & ~top
    # a layer's heads side by side: [L·R groups, H·W], and its total drop
    grouped = s.masked_fill(~pool, float("inf")).view(lanes // heads, heads, requests, w)
    grouped = grouped.transpose(1, 2).reshape(-1, heads * w)
    rank = grouped.argsort(dim=1, stable=True).argsort(dim=1)
    chosen = (rank < total) & grouped.isfinite()
    counts = chosen.view(lanes // heads, requests, heads, w).sum(dim=3).transpose(1, 2)
    return counts.reshape(-1).tolist()
