"""LazyEviction (004_a0d6af55e6947072.txt §4, App. A-B Algorithm 1): lagged eviction
that keeps tokens whose attention recurs.

Time t counts query steps from the end of the prompt: the query at position q has
t = q - prompt_len + 1 (the last prompt query is t = 0, the k-th decode query t = k),
so with one decode token per step t = seq_len - prompt_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field

from policies.base import Needs, chunked_envelope, head_mean, head_parts, resolve_budget
from policies.config import Budget, EvictingPolicyConfig, budget_field
from policies.rows import NATIVE, RowsView, drop_lowest


class LazyEvictionConfig(EvictingPolicyConfig):
    """004 defaults: r = 50% (Tables 1-2), W = 25 (best on GSM8K, Table 9), α = 5e-4
    (DS-Llama-8B, App. C / Table 10)."""

    name: Literal["lazy_eviction"] = "lazy_eviction"
    # A ratio already: it follows every model's context without a rule.
    budget: Budget = budget_field(0.5, "B: tokens kept per layer at each decision (the "
                                  "paper's r as a ratio)")
    window: int = Field(25, ge=1, description=(
        "W: eviction period in decode steps, and recent tokens always kept."))
    alpha: float = Field(5e-4, gt=0.0, le=1.0, description=(
        "α: the head-averaged attention from which a token counts as activated."))


def importance(t: int | torch.Tensor, ts: torch.Tensor, mri: torch.Tensor) -> torch.Tensor:
    """Eq. 2 as printed: I = H1 + H2 if MRI != 0 else H1, with
    H1 = 2σ(-(t - TS)/MRI) and H2 = 2σ(-1/(MRI - 1)).

    Limits where the printed formulas divide by zero: t = TS gives H1 = 1 (x = 0);
    MRI = 0 with t > TS gives H1 = 0 (x -> inf); MRI = 1 gives H2 = 0 (x -> inf).
    Note the printed H2 *grows* with MRI (2σ(-1) ≈ 0.54 at MRI = 2, -> 1 as MRI grows)
    although §4 says smaller MRI should score higher; we implement the equation."""
    ts, mri = ts.double(), mri.double()
    elapsed = t - ts
    x1 = torch.where(elapsed == 0, torch.zeros_like(ts),
                     torch.where(mri == 0, torch.full_like(ts, math.inf),
                                 elapsed / mri.clamp_min(1)))
    h1 = 2 * torch.sigmoid(-x1)
    x2 = torch.where(mri == 1, torch.full_like(mri, math.inf), 1 / (mri - 1))
    h2 = torch.where(mri == 0, torch.zeros_like(mri), 2 * torch.sigmoid(-x2))
    return h1 + h2


@dataclass
class LazyEvictionPolicy:
    """LazyEviction (004_a0d6af55e6947072.txt §4, Alg. 1, eqs. 1-2, 5).

    Recurrence Interval Tracking (every step, every query row in time order): a token
    is activated by a query when that query's attention on it, averaged over all query
    heads (`head_mean`), is >= α; then TS = t and MRI = max(MRI, t - TS_prev) (eq. 1).
    A new token starts with TS = its own time and MRI = 0. Prompt queries track too
    (App. H: prefill and decode tokens are treated alike). TS and MRI are per-slot
    state (`state`: kept by the engine beside each token's slot, moving with it; a NaN
    TS marks a token not seen yet, which takes its birth time pos - prompt_len + 1).
    Both are small integers, exact in float32; `importance` is computed in double.

    MRI-Centric Eviction (Alg. 1 line 8, eq. 5): at t = kW (k >= 1; at most once per
    window if a step spans several), if a layer holds more than B tokens, keep the most
    recent W and the top B - W of the others by I_t (`importance`); if B < W only the
    recent W stay. B = resolve_budget(budget, seq_len), so a ratio keeps the paper's
    r of the full cache. Each request decides on its own clock (`_epoch`, the last k
    decided), so in a batch some rows select while the others only track.

    The prompt (our definition: the paper decides at decode steps t = kW only, its
    prompts being short): every prompt chunk ends with a decision at its last query's
    time t <= 0, the one that completes the prompt (t = 0) included, with B resolved on
    the whole prompt's length (`prompt_budget`). §4/App. H treat prompt and generated
    tokens alike ("If a Prefill token shows no recurrence over a long period,
    LazyEviction evicts it"), and this is what bounds a long prompt's memory from its
    first token (issue 20: the scheduler prefills it in chunks of about B). Before this,
    nothing was evicted before t = W, so a prompt of any length was held whole.

    Bound: max(B, W) after every prompt chunk; in decode max(B, W) + (t mod W) <=
    max(B, W) + W - 1. kvpress has no LazyEviction press."""

    config: LazyEvictionConfig
    name: str = "lazy_eviction"
    needs: Needs = field(default_factory=lambda: Needs(attention=True))
    state: ClassVar[dict[str, float]] = {"ts": math.nan, "mri": 0.0}
    # Updated where the tables keep them (RowsView.in_place): a decode step changes a few.
    state_in_place: ClassVar[tuple[str, ...]] = ("ts", "mri")
    _epoch: int = 0  # last k with an eviction decision at t = kW

    @staticmethod
    def select(policies: list[LazyEvictionPolicy], view: RowsView) -> torch.Tensor | None:
        """Track every row over this step's queries; the rows of the requests that
        computed a prompt chunk or whose clock reached a new t = kW keep max(B, W)
        tokens: the recent W and the highest I_t among the others."""
        c = policies[0].config
        assert view.attention is not None
        _track(view, c.alpha)
        keep, t_now = [], []
        for p, s, prompt in zip(policies, view.seq_len, view.prompt_len):
            t = s - prompt  # the time of this step's last query
            epoch = t // c.window if t >= c.window else 0
            decide = t <= 0 or epoch > p._epoch  # every prompt chunk, then t = kW
            if decide:
                p._epoch = max(epoch, p._epoch)
            budget = resolve_budget(c.budget, max(s, prompt))
            keep.append(max(budget, c.window) if decide else None)
            t_now.append(t)
        keep = [n if k is None else k for n, k in zip(view.lengths, view.per_row(keep))]
        if view.within(keep):
            return None
        # Only the deciding rows are scored: requests reach t = kW on their own clocks,
        # so a step's group usually has a few (eq. 2 is a dozen sweeps in double).
        rows = [i for i, (n, k) in enumerate(zip(view.lengths, keep)) if n > k]
        r = view.num_requests
        times = [t_now[i % r] for i in rows]
        if NATIVE["state"] and view.slot_pos.device.type == "cpu":  # one pass (C++)
            # every row's scores (0 where no drop), selected over the view's own rows
            scores = torch.ops.kvserve_policy_state.lazy_importance(
                view.layered("ts"), view.layered("mri"), rows, times)
            return drop_lowest(view.live_or_positions, scores, view.excess(keep),
                               last=c.window)
        # [L, R, W] -> the deciding rows; TS and MRI are small integers, exact in float32
        at = torch.tensor(rows)
        ts, mri = (view.layered(name)[at // r, at % r].double() for name in ("ts", "mri"))
        scores = importance(torch.tensor(times, dtype=torch.float64)[:, None], ts, mri)
        drop = drop_lowest(view.positions_of(at), scores,
                           [view.lengths[i] - keep[i] for i in rows], last=c.window)
        return view.rows_mask(at, drop)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        w = self.config.window
        return chunked_envelope(self.config.budget, seq_len, prompt_len, over=w - 1, least=w)


def _track(view: RowsView, alpha: float) -> None:
    """Recurrence Interval Tracking over this step's queries, into the view's TS and MRI
    state. A decode step (one query) on CPU is one C++ pass per row
    (policies/csrc/state_cpu.cpp::lazy_track, the torch form's contract: `head_mean`'s
    division in float32, then the same comparisons) instead of a dozen sweeps over
    every slot in double."""
    assert view.attention is not None
    ts, mri = view.layered("ts"), view.layered("mri")  # [L, R, W]
    if view.attention.shape[1] == 1 and NATIVE["state"] and ts.device.type == "cpu":
        mass, total = head_parts(view.attention)  # [N, 1, W], [N, 1]
        torch.ops.kvserve_policy_state.lazy_track(
            ts, mri, mass[:, 0], total[:, 0], view.slot_pos,
            [s - 1 for s in view.seq_len], view.prompt_len, alpha)
        return
    new_ts, new_mri = _tracked(view, alpha)
    ts.copy_(new_ts.view(ts.shape))
    mri.copy_(new_mri.view(mri.shape))


def _tracked(view: RowsView, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrence Interval Tracking over this step's query rows for every row of the
    view: the per-slot (TS, MRI) -> updated, in double ([N, W] each). A NaN TS (a token
    not seen yet) starts at the time of the query that created it; dead slots are never
    activated."""
    pos = view.positions
    q0 = view.row_tensor(view.per_row([s - view.num_new for s in view.seq_len]))
    prompt = view.row_tensor(view.per_row(view.prompt_len))  # [N, 1] each
    born = pos - prompt + 1  # time of the query that created each token
    n, w = pos.shape
    ts = view.layered("ts").reshape(n, w).double()
    ts = torch.where(torch.isnan(ts), born.double(), ts)
    mri = view.layered("mri").reshape(n, w).double()
    assert view.attention is not None
    tq = view.attention.shape[1]
    qpos = q0 + torch.arange(tq)  # [N, Tq]
    t = (qpos - prompt + 1).double()[..., None]  # [N, Tq, 1]
    act = (head_mean(view.attention) >= alpha) & (pos.unsqueeze(-2) <= qpos[..., None]) \
        & view.live.unsqueeze(-2)
    if tq == 1:  # a decode step: one query, no running maximum over queries
        act, t = act[:, 0], t[:, 0]
        mri = torch.maximum(mri, torch.where(act, t - ts, 0.0))
        return torch.where(act, torch.maximum(ts, t), ts), mri
    stamp = torch.where(act, t, torch.full_like(t, -math.inf))  # [N, Tq, W]
    last = torch.cummax(stamp, dim=-2).values  # latest activation up to each row
    first = ts.unsqueeze(-2)
    prev = torch.cat([first, torch.maximum(last[..., :-1, :], first)], dim=-2)
    gap = torch.where(act, t - prev, torch.zeros_like(prev))
    mri = torch.maximum(mri, gap.max(dim=-2).values)
    ts = torch.maximum(ts, last[..., -1, :])
    return ts, mri
