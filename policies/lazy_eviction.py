"""LazyEviction (004_a0d6af55e6947072.txt §4, App. A-B Algorithm 1): lagged eviction
that keeps tokens whose attention recurs.

Time t counts query steps from the end of the prompt: the query at position q has
t = q - prompt_len + 1 (the last prompt query is t = 0, the k-th decode query t = k),
so with one decode token per step t = seq_len - prompt_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field

from policies.base import (
    BatchView,
    Eviction,
    Needs,
    StepView,
    align,
    align_rows,
    drop_index_rows,
    edge_mask,
    evict_except,
    head_mean,
    resolve_budget,
    without_rows,
)
from policies.config import Budget, EvictingPolicyConfig, budget_field


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
    (App. H: prefill and decode tokens are treated alike).

    MRI-Centric Eviction (Alg. 1 line 8, eq. 5): at t = kW (k >= 1; at most once per
    window if a step spans several), if a layer holds more than B tokens, keep the most
    recent W and the top B - W of the others by I_t (`importance`); if B < W only the
    recent W stay. B = resolve_budget(budget, seq_len), so a ratio keeps the paper's
    r of the full cache. Nothing is evicted before t = W, even for a long prompt.

    Bound: live <= seq_len while t < W, i.e. <= prompt_len + W - 1; afterwards <=
    max(B, W) + (t mod W) <= max(B, W) + W - 1. kvpress has no LazyEviction press."""

    config: LazyEvictionConfig
    name: str = "lazy_eviction"
    needs: Needs = field(default_factory=lambda: Needs(attention=True))
    _pos: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _ts: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _mri: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _epoch: int = 0  # last k with an eviction decision at t = kW

    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, TS, MRI) tracked for a layer."""
        return self._pos[layer], self._ts[layer], self._mri[layer]

    def step(self, view: StepView) -> Eviction:
        c = self.config
        prompt = view.prompt_len
        t_now = view.seq_len - prompt
        epoch = t_now // c.window if t_now >= c.window else 0
        decide = epoch > self._epoch
        if decide:
            self._epoch = epoch
        budget = resolve_budget(c.budget, view.seq_len)
        rows = self._step_rows(view, t_now, decide, budget)
        if rows is not None:
            return rows
        plan: Eviction = {}
        for layer, lv in enumerate(view.layers):
            assert lv.attention is not None
            self._track(layer, lv.positions, lv.attention, view.seq_len - view.num_new,
                        prompt)
            n = lv.positions.numel()
            if not decide or n <= budget:
                continue
            pos, ts, mri = self.state(layer)
            scores = importance(t_now, ts, mri)
            recent = min(c.window, n)
            drop = evict_except(scores, pos, max(budget, recent), edge_mask(n, 0, recent))
            if drop.numel() == 0:  # B < W and no more than W tokens
                continue
            plan[layer] = drop
            kept = ~torch.isin(pos, drop)
            self._pos[layer], self._ts[layer], self._mri[layer] = pos[kept], ts[kept], mri[kept]
        return plan

    def _step_rows(self, view: StepView, t_now: int, decide: bool,
                   budget: int) -> Eviction | None:
        """`step` for all layers at once ([L, n] state, one op per stage instead of one
        per layer) when every layer holds the same count — always, unless the engine
        carried out a plan differently: every layer holds max(B, W) after a decision and
        gains the same new tokens. None otherwise. The same elementwise arithmetic per
        row as the per-layer loop, so the same TS, MRI and kept sets."""
        pos, att = view.stacked("positions"), view.stacked("attention")
        if pos is None or att is None:
            return None
        nl = pos.shape[0]
        old = [self._pos.get(layer) for layer in range(nl)]
        if any(p is None for p in old) or len({p.numel() for p in old}) != 1:
            ts = torch.stack([align(self._pos.get(layer), self._ts.get(layer), pos[layer],
                                    fill=math.nan) for layer in range(nl)])
            mri = torch.stack([align(self._pos.get(layer), self._mri.get(layer), pos[layer],
                                     fill=0) for layer in range(nl)])
        else:
            old_pos = torch.stack(old)
            ts = align_rows(old_pos, torch.stack([self._ts[layer] for layer in range(nl)]),
                            pos, fill=math.nan)
            mri = align_rows(old_pos, torch.stack([self._mri[layer] for layer in range(nl)]),
                             pos, fill=0)
        ts, mri = self._tracked(pos, att, ts, mri, view.seq_len - view.num_new,
                                view.prompt_len)
        n = pos.shape[1]
        recent = min(self.config.window, n)
        keep = max(budget, recent)
        plan: Eviction = {}
        if decide and n > budget and keep < n:
            drop = drop_index_rows(importance(t_now, ts, mri), keep, recent)
            plan = dict(enumerate(pos.gather(1, drop).unbind(0)))
            pos, ts, mri = without_rows(drop, pos, ts, mri)
        self._pos.update(enumerate(pos.unbind(0)))
        self._ts.update(enumerate(ts.unbind(0)))
        self._mri.update(enumerate(mri.unbind(0)))
        return plan

    def _track(self, layer: int, pos: torch.Tensor, attention: torch.Tensor, q0: int,
               prompt: int) -> None:
        ts = align(self._pos.get(layer), self._ts.get(layer), pos, fill=math.nan)
        mri = align(self._pos.get(layer), self._mri.get(layer), pos, fill=0)
        ts, mri = self._tracked(pos, attention, ts, mri, q0, prompt)
        self._pos[layer], self._ts[layer], self._mri[layer] = pos, ts, mri

    @staticmethod
    def step_batch(policies: list[LazyEvictionPolicy],
                   view: BatchView) -> list[torch.Tensor] | None:
        """`_step_rows` for R requests at once (rows r·L + l): tracking for all rows in
        one pass; each member decides on its own clock (t = kW), and the members that
        decide select together. Their states must hold the same count in every layer."""
        c, nl = policies[0].config, view.num_layers
        budget = view.budget(c.budget)
        if budget is None or view.attention is None:
            return None
        old = [p._pos.get(layer) for p in policies for layer in range(nl)]
        if any(x is None for x in old) or len({x.numel() for x in old}) != 1:
            return None
        old_pos = torch.stack(old)
        ts = align_rows(old_pos, torch.stack([p._ts[lay] for p in policies for lay in range(nl)]),
                        view.positions, fill=math.nan)
        mri = align_rows(old_pos, torch.stack([p._mri[lay] for p in policies for lay in range(nl)]),
                         view.positions, fill=0)
        rows = torch.tensor([[s - 1, p] for s, p in zip(view.seq_len, view.prompt_len)])
        rows = rows.repeat_interleave(nl, dim=0)  # [R·L, 2]: (q0, prompt_len) per row
        ts, mri = policies[0]._tracked(view.positions, view.attention[:, None], ts, mri,
                                       rows[:, :1], rows[:, 1:])
        pos, n = view.positions, view.positions.shape[1]
        recent = min(c.window, n)
        keep = max(budget, recent)
        t_now = [s - p for s, p in zip(view.seq_len, view.prompt_len)]
        epochs = [t // c.window if t >= c.window else 0 for t in t_now]
        decide = [e > p._epoch for e, p in zip(epochs, policies)]
        for e, p, d in zip(epochs, policies, decide):
            if d:
                p._epoch = e
        drops = [pos.new_empty((nl, 0))] * len(policies)
        pos_rows, ts_rows, mri_rows = list(pos.unbind(0)), list(ts.unbind(0)), list(mri.unbind(0))
        who = [r for r, d in enumerate(decide) if d]
        if who and n > budget and keep < n:
            sel = torch.tensor([r * nl + lay for r in who for lay in range(nl)])
            t = torch.tensor([t_now[r] for r in who]).repeat_interleave(nl)[:, None]
            drop = drop_index_rows(importance(t, ts[sel], mri[sel]), keep, recent)
            left = without_rows(drop, pos[sel], ts[sel], mri[sel])
            for part, rows_ in zip(left, (pos_rows, ts_rows, mri_rows)):
                for row, kept in zip(sel.tolist(), part.unbind(0)):  # one op for all
                    rows_[row] = kept
            for r, d in zip(who, drop.view(len(who), nl, -1).unbind(0)):
                drops[r] = d
        for r, p in enumerate(policies):
            span = range(r * nl, (r + 1) * nl)
            p._pos.update(zip(range(nl), (pos_rows[i] for i in span)))
            p._ts.update(zip(range(nl), (ts_rows[i] for i in span)))
            p._mri.update(zip(range(nl), (mri_rows[i] for i in span)))
        return drops

    def _tracked(self, pos: torch.Tensor, attention: torch.Tensor, ts: torch.Tensor,
                 mri: torch.Tensor, q0: int | torch.Tensor,
                 prompt: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrence Interval Tracking over this step's query rows: (TS, MRI) aligned to
        `pos` (NaN TS: new token) -> updated. One layer (pos [n], attention [Tq, Hkv, n]),
        all layers stacked (a leading L on every argument), or rows of several requests
        (q0 and prompt then [rows, 1] tensors)."""
        born = pos - prompt + 1  # time of the query that created each token
        ts = torch.where(torch.isnan(ts), born.double(), ts.double())
        mri = mri.long()
        tq = attention.shape[-3]
        qpos = q0 + torch.arange(tq)  # [Tq], or [rows, Tq]
        t = (qpos - prompt + 1).double()[..., None]  # [..., Tq, 1]
        act = (head_mean(attention) >= self.config.alpha) & \
            (pos.unsqueeze(-2) <= qpos[..., None])
        stamp = torch.where(act, t, torch.full_like(t, -math.inf))  # [..., Tq, n]
        last = torch.cummax(stamp, dim=-2).values  # latest activation up to each row
        first = ts.unsqueeze(-2)
        prev = torch.cat([first, torch.maximum(last[..., :-1, :], first)], dim=-2)
        gap = torch.where(act, t - prev, torch.zeros_like(prev))
        mri = torch.maximum(mri, gap.max(dim=-2).values.long())
        ts = torch.maximum(ts, last[..., -1, :])
        return ts, mri

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        w = self.config.window
        steady = max(resolve_budget(self.config.budget, seq_len), w) + w - 1
        before = seq_len if prompt_len is None else prompt_len + w - 1
        return min(seq_len, max(before, steady))
