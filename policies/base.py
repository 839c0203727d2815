"""What a KV eviction policy sees and returns.

A policy is a small object built from one request's validated `kv_policy` config. After
every step that computed tokens for its request the engine hands it a `StepView` — the
live tokens of every layer, identified by their *original positions*, with the
statistics the policy declared it needs — and the policy answers with an `Eviction`:
per layer, the original positions to drop. It never frees memory nor reads the pool:
the engine carries the plan out (marking slots dead, returning empty blocks at once,
optionally compacting or re-rotating keys), so policies are pure functions of
(config, their own state, the view) and testable without a model.

Tokens are identified by position rather than slot because slots move when blocks are
freed or compacted, while a token's position never changes (with `rope: "shift"` the
engine re-numbers positions; policies that allow it only rely on their order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

# An eviction plan: layer -> original positions to drop (int64, any order).
Eviction = dict[int, torch.Tensor]


@dataclass(frozen=True)
class Needs:
    """Statistics a policy asks for; the engine computes only these, only for it.
    Frozen (a policy that changes what it needs assigns a new one), so it can be part
    of a batch's key."""

    attention: bool = False  # attention mass of this step's queries over live tokens
    key_norm: bool = False  # ‖K‖₂ per live token and kv head
    value_norm: bool = False  # ‖V‖₂ per live token and kv head
    keys: bool = False  # the key vectors themselves (as stored: rotated)
    # ‖K‖₂ of this step's new tokens only: for a policy that keeps each token's norm from
    # the step that computed it (a stored key never changes), so a step costs O(new).
    new_key_norm: bool = False


@dataclass
class LayerView:
    positions: torch.Tensor  # [n] int64, ascending: live tokens of this layer
    # [Tq, Hkv, n] float32: this step's queries' probability mass per live token, summed
    # over the query heads of each kv group (so it sums to G per query and kv head).
    attention: torch.Tensor | None = None
    key_norm: torch.Tensor | None = None  # [n, Hkv] float32
    value_norm: torch.Tensor | None = None  # [n, Hkv] float32
    keys: torch.Tensor | None = None  # [n, Hkv, D] float32
    # [num_new, Hkv] float32: the norms of the newest num_new positions (this step's)
    new_key_norm: torch.Tensor | None = None


@dataclass
class StepView:
    seq_len: int  # tokens processed so far (prompt + generated, whose K/V were computed)
    prompt_len: int
    num_new: int  # tokens computed this step (queries of `attention`)
    prefill_done: bool  # this step computed the last prompt token (first time only)
    block_size: int
    layers: list[LayerView] = field(default_factory=list)
    # Live tokens per layer (before this step's plan). The engine fills it before any
    # layer view is built, so that `idle` can decide from sizes alone.
    lengths: list[int] = field(default_factory=list)

    # [L, n, ...] copies of LayerView fields when every layer holds n tokens (`stacked`);
    # the engine pre-fills them from its one gather for all layers.
    stacks: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.lengths and self.layers:
            self.lengths = [lv.positions.numel() for lv in self.layers]

    def stacked(self, name: str) -> torch.Tensor | None:
        """LayerView field `name` of every layer as one [L, n, ...] tensor, or None when
        layers hold different counts: lets a policy score and select for all layers in
        one op each instead of a loop of small per-layer ops."""
        if not self.layers or len(set(self.lengths)) != 1:
            return None
        if name not in self.stacks:
            parts = [getattr(lv, name) for lv in self.layers]
            if any(p is None for p in parts):
                return None
            self.stacks[name] = torch.stack(parts)
        return self.stacks[name]

    @property
    def num_layers(self) -> int:
        return len(self.lengths) or len(self.layers)


@dataclass
class BatchView:
    """One decode step of R requests under the same policy class and config, every
    (request, layer) holding the same n live tokens: row r·L + l is layer l of request
    r. What a decode step of a scoring policy looks like once the prompt is planned
    (every layer at C + 1), so the policy can score and select for all requests in one
    op per stage (`step_batch`) instead of a few dozen small ops per request.

    Row fields are the `StepView.stacked` ones with a leading R·L instead of L, and
    `attention` is the single query's mass ([R·L, Hkv, n], `LayerView.attention[0]`)."""

    seq_len: list[int]  # per request, as StepView.seq_len
    prompt_len: list[int]
    num_layers: int
    positions: torch.Tensor  # [R·L, n] int64, ascending per row
    attention: torch.Tensor | None = None  # [R·L, Hkv, n] float32
    key_norm: torch.Tensor | None = None  # [R·L, n, Hkv] float32
    value_norm: torch.Tensor | None = None
    keys: torch.Tensor | None = None  # [R·L, n, Hkv, D] float32
    new_key_norm: torch.Tensor | None = None  # [R·L, 1, Hkv] float32: the newest token's

    def per_request(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """[R·L, ...] rows -> R tensors of [L, ...] (what `step_batch` returns)."""
        return list(rows.split(self.num_layers))

    def budget(self, budget: int | float) -> int | None:
        """The budget every member resolves to, or None when they differ (a ratio on
        different lengths): a batch selects one count for all rows."""
        values = {resolve_budget(budget, s) for s in self.seq_len}
        return values.pop() if len(values) == 1 else None


class Policy(Protocol):
    name: str
    needs: Needs  # may be narrowed by `step` (e.g. snapkv stops needing attention)

    def step(self, view: StepView) -> Eviction:
        """Called after every step that computed tokens of this request."""
        ...

    # Optional: `idle(view) -> bool`, given a view whose `layers` are not built yet (only
    # the step's sizes and `lengths`): True only when `step` would return no plan *and*
    # leave the policy's state unchanged, so the engine may skip building the view. A
    # policy that accumulates statistics every step (h2o, pyramid, lazy_eviction) has
    # none. Building a view costs more than most plans (tests/test_policies_idle.py
    # checks every `idle` against `step`).

    # Optional: `step_batch(policies, view: BatchView) -> list[Tensor] | None`, a
    # staticmethod taking this class's policies of R requests with equal configs: per
    # request, [L, d] ascending indices into each layer's n tokens to drop (d may be 0),
    # the same tokens `step` would drop on that request's own view, with each policy's
    # state updated as `step` would. None (nothing changed) sends every member down
    # `step` instead.

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        """Most live tokens any one layer holds after this policy's plan was applied, at
        any step whose sequence length is <= seq_len (non-decreasing in seq_len).

        `prompt_len` None means the worst prompt length; `block_size` (the pool's) only
        matters to block-granular policies. During a step, before the plan, a layer
        also holds that step's new tokens: the engine adds one chunk to this bound."""
        ...

    # Optional: `max_live_total(seq_len, prompt_len, block_size, num_layers) -> int`,
    # the most live tokens summed over all layers, for a policy whose layers hold
    # different counts (pyramid): admission reserves by it when it is below
    # num_layers · max_live (blocks are fungible across layers).


def resolve_budget(budget: int | float, length: int) -> int:
    """A budget is a token count (int >= 1) or a ratio of `length` (float in (0, 1])."""
    if isinstance(budget, float):
        return max(1, round(budget * length))
    return budget


def keep_top(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Positions NOT among the k highest scores (the ones to evict).

    Ties break toward the earlier position (stable), so results are deterministic."""
    n = positions.numel()
    if k >= n:
        return positions[:0]
    return positions[lowest_index_rows(scores[None], n - k)[0]].sort().values


# Up to this many drops per row a partial top-k plus a tie count beats a full stable sort
# (about 10x on a thousand scores); beyond it (the prompt's one big plan) we sort.
_TOPK_MAX = 64


def lowest_index_rows(scores: torch.Tensor, d: int) -> torch.Tensor:
    """[L, m] scores -> [L, d] ascending indices of the d lowest per row, ties toward the
    later index: exactly the last d of a stable descending sort (what `keep_top` drops).

    Decode drops a token or a few per step, so this is a top-k for the d-th lowest value
    t, every score < t, and of the scores == t the last ones — a handful of cheap ops
    instead of a stable sort of the whole row. A NaN among the d lowest (sort and top-k
    may order NaN differently) falls back to the sort."""
    m = scores.shape[1]
    if 0 < d <= min(_TOPK_MAX, m - 1):
        low = torch.topk(scores, d, dim=1, largest=False).values
        if not bool(torch.isnan(low).any()):
            t = low[:, d - 1 :]
            below = scores < t
            tied = scores == t
            wanted = d - below.sum(dim=1, keepdim=True)  # ties to drop, from the end
            from_end = tied.flip(1).cumsum(dim=1).flip(1)
            drop = below | (tied & (from_end <= wanted))
            return drop.nonzero()[:, 1].view(scores.shape[0], d)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return order[:, m - d :].sort(dim=1).values


# ---- helpers shared by several policies ------------------------------------------------


def is_active(view: StepView) -> bool:
    """The prompt is complete: policies that score the whole prompt act from here on."""
    return view.prefill_done or view.seq_len > view.prompt_len


def prompt_budget(budget: int | float, view: StepView) -> int:
    """C during a prompt and after it: resolved on the whole prompt length while the
    prompt is still being computed (so every prompt chunk aims at the C the prompt's end
    will have), on the sequence length from then on."""
    return resolve_budget(budget, max(view.seq_len, view.prompt_len))


def chunked_envelope(budget: int | float, seq_len: int, prompt_len: int | None,
                     over: int = 0) -> int:
    """`max_live` of a policy that evicts down to C after every prompt chunk and keeps
    at most C + `over` tokens in decode (C = `prompt_budget`): bounded from the first
    prompt token on. A ratio budget with an unknown prompt length bounds nothing."""
    if prompt_len is None and isinstance(budget, float):
        return seq_len
    c = resolve_budget(budget, max(seq_len, prompt_len or 0))
    return min(seq_len, c + (over if prompt_len is None or seq_len > prompt_len else 0))


def prefill_envelope(seq_len: int, prompt_len: int | None, after: int) -> int:
    """`max_live` of a policy that evicts nothing before the prompt is complete and at
    most `after` live tokens from then on: intermediate prefill chunks keep up to
    prompt_len - 1 tokens, and with an unknown prompt length every token may still be
    part of the prompt."""
    if prompt_len is None or seq_len < prompt_len:
        return seq_len
    return min(seq_len, max(prompt_len - 1, after))


def align(old_pos: torch.Tensor | None, old_val: torch.Tensor | None,
          new_pos: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-token state (dim 0 indexed like `old_pos`) re-indexed to `new_pos`.

    Both position lists are ascending. Tokens evicted since are dropped; tokens not
    seen before get `fill`. Policies keep state by position so they never depend on
    the engine carrying out a plan exactly as returned."""
    if old_pos is None or old_val is None or old_pos.numel() == 0:
        shape = (new_pos.numel(), *(() if old_val is None else old_val.shape[1:]))
        dtype = torch.float32 if old_val is None else old_val.dtype
        return torch.full(shape, fill, dtype=dtype)
    if _appended(old_pos, new_pos):
        return _extend(old_val, new_pos.shape[-1], fill, dim=0)
    idx = torch.searchsorted(old_pos, new_pos).clamp_(max=old_pos.numel() - 1)
    hit = old_pos[idx] == new_pos
    out = torch.full((new_pos.numel(), *old_val.shape[1:]), fill, dtype=old_val.dtype)
    out[hit] = old_val[idx[hit]]
    return out


def _appended(old_pos: torch.Tensor, new_pos: torch.Tensor) -> bool:
    """`new_pos` is `old_pos` followed by new tokens only (along the last dim): the
    usual decode step once our own plan was carried out. Then `align` is a plain
    append — no searchsorted, which costs as much as a sort on a thousand tokens."""
    m = old_pos.shape[-1]
    return m <= new_pos.shape[-1] and torch.equal(new_pos[..., :m], old_pos)


def _extend(old_val: torch.Tensor, n: int, fill: float, dim: int) -> torch.Tensor:
    """`old_val` followed by `fill` up to n entries along `dim` (what `align` gives for
    appended positions: every old one hit, in order; every new one missed)."""
    shape = list(old_val.shape)
    shape[dim] = n - shape[dim]
    return torch.cat([old_val, torch.full(shape, fill, dtype=old_val.dtype)], dim=dim)


def head_mean(attention: torch.Tensor) -> torch.Tensor:
    """[Tq, Hkv, n] mass summed per kv group -> [Tq, n] probability averaged over all
    query heads (each row sums to 1): every query row of the view sums to H = Hkv*G.
    Leading dims (layers stacked by `StepView.stacked`) are kept."""
    total = attention.sum(dim=(-2, -1), keepdim=False).clamp_min(1e-30)
    return attention.sum(dim=-2) / total[..., None]


def evict_except(scores: torch.Tensor, positions: torch.Tensor, keep: int,
                 protected: torch.Tensor | None = None) -> torch.Tensor:
    """Positions to drop so that `keep` tokens stay: all `protected` ones (bool mask
    over positions, assumed fewer than `keep`), then the highest `scores` among the
    rest (ties toward the earlier position, as `keep_top`)."""
    if protected is None or not bool(protected.any()):
        return keep_top(scores, positions, keep)
    free = ~protected
    return keep_top(scores[free], positions[free], max(0, keep - int(protected.sum())))


def evict_except_index(scores: torch.Tensor, keep: int, first: int = 0,
                       last: int = 0) -> torch.Tensor:
    """`evict_except(scores, positions, keep, edge_mask(n, first, last))` as ascending
    indices into the n tokens (positions ascending) instead of positions, so a policy
    drops them from its own per-token state by index rather than by a search."""
    n = scores.numel()
    lo = min(first, n)
    hi = max(lo, n - last if last > 0 else n)  # the unprotected tokens: [lo, hi)
    protected = n - (hi - lo)
    d = (hi - lo) - (keep if protected == 0 else max(0, keep - protected))
    if d <= 0:
        return torch.empty(0, dtype=torch.int64)
    return lowest_index_rows(scores[None, lo:hi], d)[0] + lo


def drop_index_rows(scores: torch.Tensor, keep: int, last: int = 0) -> torch.Tensor:
    """`evict_except` for L layers at once ([L, n] scores, the same n and `keep` < n in
    every layer) with the `last` most recent tokens protected (`edge_mask(n, 0, last)`,
    last <= keep): [L, n - keep] ascending indices to drop, row l the tokens that
    evict_except drops on layer l (the same selection, one op each for all rows)."""
    free = scores.shape[1] - last
    return lowest_index_rows(scores[:, :free], free - (keep - last))


def without_rows(drop: torch.Tensor, *rows: torch.Tensor) -> list[torch.Tensor]:
    """Each [R, n] tensor without its row's [R, d] dropped indices (ascending, as
    `drop_index_rows` gives them): [R, n - d] each, order kept. The j-th kept index is
    j plus the number of drops i with drop[i] - i <= j — one searchsorted for all rows,
    then a gather per tensor, instead of a boolean mask's nonzero and copy per tensor."""
    r, d = drop.shape
    n = rows[0].shape[1]
    kept = torch.arange(n - d).expand(r, -1).contiguous()
    kept += torch.searchsorted((drop - torch.arange(d)).contiguous(), kept, right=True)
    return [x.gather(1, kept) for x in rows]


def keep_rows(scores: torch.Tensor, keep: int, last: int,
              *rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The [R, d] indices `drop_index_rows` drops (d = 0 when rows hold <= keep) and each
    of `rows` without them: the select-and-forget step of a policy that keeps per-token
    state beside its positions, for all rows of a batch at once (h2o, knorm)."""
    if scores.shape[1] <= keep:
        return torch.empty((scores.shape[0], 0), dtype=torch.int64), list(rows)
    drop = drop_index_rows(scores, keep, last)
    return drop, without_rows(drop, *rows)


def evict_except_rows(scores: torch.Tensor, positions: torch.Tensor, keep: int,
                      last: int = 0) -> torch.Tensor:
    """`drop_index_rows` as positions ([L, n] ascending per row): [L, n - keep]."""
    return positions.gather(1, drop_index_rows(scores, keep, last))


def align_rows(old_pos: torch.Tensor, old_val: torch.Tensor, new_pos: torch.Tensor,
               fill: float = 0.0) -> torch.Tensor:
    """`align` of L layers at once: [L, m] positions and values -> [L, n] values at
    `new_pos` (m > 0; every row ascending), one searchsorted for all rows."""
    if _appended(old_pos, new_pos):
        return _extend(old_val, new_pos.shape[1], fill, dim=1)
    new_pos = new_pos.contiguous()
    idx = torch.searchsorted(old_pos, new_pos).clamp_(max=old_pos.shape[1] - 1)
    hit = old_pos.gather(1, idx) == new_pos
    return torch.where(hit, old_val.gather(1, idx), torch.tensor(fill, dtype=old_val.dtype))


def edge_mask(n: int, first: int, last: int) -> torch.Tensor:
    """Bool mask over n tokens in kept order: the first `first` and the last `last`."""
    mask = torch.zeros(n, dtype=torch.bool)
    mask[: min(first, n)] = True
    if last > 0:
        mask[max(0, n - last):] = True
    return mask
