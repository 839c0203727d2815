"""Attention-mass policies that act every step: H2O (`h2o`) and TOVA (`tova`).

Both read `LayerView.attention` ([Tq, Hkv, n]: this step's queries' probability mass on
each live token, summed over the query heads of each kv group) and keep one set per
layer, i.e. the mass is aggregated over all heads of the layer. Both act from the step
that completes the prompt on (scores of a partial prompt would be premature), keeping
exactly min(n, C) tokens after every plan, C = resolve_budget(budget, seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

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
    evict_except_rows,
    head_mean,
    is_active,
    keep_rows,
    prefill_envelope,
    resolve_budget,
    without_rows,
)
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field


class H2OConfig(EvictingPolicyConfig):
    """003 `H2OEviction(budget, recent_window=128)`; budget 1024 as in 003's comparison."""

    name: Literal["h2o"] = "h2o"
    budget: Budget = budget_field(1024)
    window: int = Field(128, ge=0, description=(
        "Most recent tokens always kept, part of the budget; the rest are the heaviest "
        "hitters by cumulative attention."))

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {
        "budget": ContextDefault(0.25), "window": ContextDefault(1 / 32)}


class TOVAConfig(EvictingPolicyConfig):
    name: Literal["tova"] = "tova"
    budget: Budget = budget_field(1024)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


@dataclass
class H2OPolicy:
    """Heavy-Hitter Oracle (Zhang et al. 2023) as 003_12df107fdefa535c.txt
    `H2OEviction` ("Eviction Policies"); 004_a0d6af55e6947072.txt §2/App. C baseline.

    Cumulative attention: every step adds its queries' mass on each live token, summed
    over queries and over all heads (003 `update`: `attention_weights.sum(dim=(0, 1, 2))`);
    prefill chunks accumulate too, so at the end of the prompt a token's score is its
    column sum over all prompt queries. Evicted tokens' scores are forgotten; new tokens
    start at 0 plus this step's mass. Keep (003 `get_eviction_mask`): the last
    min(window, C) tokens, plus the top C - window of the older tokens by cumulative
    score. Deliberate difference from kvpress `ObservedAttentionPress` ("related to
    H2O"): kvpress divides each token's summed attention by the number of queries that
    could see it and averages heads per group; H2O and 003 use the raw sum."""

    config: H2OConfig
    name: str = "h2o"
    needs: Needs = field(default_factory=lambda: Needs(attention=True))
    _pos: list[torch.Tensor | None] = field(default_factory=list, repr=False)
    _acc: list[torch.Tensor | None] = field(default_factory=list, repr=False)

    def scores(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(positions, cumulative attention) held for a layer (for tests and metrics)."""
        return self._pos[layer], self._acc[layer]

    def step(self, view: StepView) -> Eviction:
        if len(self._pos) < view.num_layers:
            self._pos += [None] * (view.num_layers - len(self._pos))
            self._acc += [None] * (view.num_layers - len(self._acc))
        budget = resolve_budget(self.config.budget, view.seq_len)
        active = is_active(view)
        rows = self._step_rows(view, budget, active)
        if rows is not None:
            return rows
        plan: Eviction = {}
        for layer, lv in enumerate(view.layers):
            assert lv.attention is not None
            acc = align(self._pos[layer], self._acc[layer], lv.positions)
            acc += lv.attention.sum(dim=(0, 1)).to(acc.dtype)
            pos = lv.positions
            n = pos.numel()
            if active and n > budget:
                protected = edge_mask(n, 0, min(self.config.window, budget))
                drop = evict_except(acc, pos, budget, protected)
                plan[layer] = drop
                keep = ~torch.isin(pos, drop)
                pos, acc = pos[keep], acc[keep]
            self._pos[layer], self._acc[layer] = pos, acc
        return plan

    def _step_rows(self, view: StepView, budget: int, active: bool) -> Eviction | None:
        """`step` for all layers at once when every layer holds the same count now and
        held the same count before (decode after the prompt's plan: C + 1 and C);
        None otherwise. Same arithmetic per row as the per-layer loop."""
        pos, att = view.stacked("positions"), view.stacked("attention")
        old = self._pos[: view.num_layers]
        if pos is None or att is None or any(p is None for p in old) or \
                len({p.numel() for p in old}) != 1 or old[0].numel() == 0:
            return None
        acc = align_rows(torch.stack(old), torch.stack(self._acc[: view.num_layers]), pos)
        acc += att.sum(dim=(1, 2)).to(acc.dtype)
        n = pos.shape[1]
        plan: Eviction = {}
        if active and n > budget:
            drop = drop_index_rows(acc, budget, min(self.config.window, budget))
            plan = dict(enumerate(pos.gather(1, drop).unbind(0)))
            pos, acc = without_rows(drop, pos, acc)
        self._pos[: len(old)], self._acc[: len(old)] = list(pos.unbind(0)), list(acc.unbind(0))
        return plan

    @staticmethod
    def step_batch(policies: list[H2OPolicy], view: BatchView) -> list[torch.Tensor] | None:
        """`_step_rows` for R requests at once (rows r·L + l): their states must hold
        the same count in every layer (decode at the budget: C before the step's new
        token, C + 1 with it)."""
        budget, nl = view.budget(policies[0].config.budget), view.num_layers
        if budget is None or view.attention is None:
            return None
        old = [x for p in policies for x in p._pos[:nl]]
        if len(old) != len(policies) * nl or any(x is None for x in old) or \
                len({x.numel() for x in old}) != 1 or old[0].numel() == 0:
            return None
        acc_old = torch.stack([x for p in policies for x in p._acc[:nl]])
        acc = align_rows(torch.stack(old), acc_old, view.positions)
        acc += view.attention.sum(dim=1).to(acc.dtype)
        window = min(policies[0].config.window, budget)
        drop, (pos, acc) = keep_rows(acc, budget, window, view.positions, acc)
        pos_rows, acc_rows = pos.unbind(0), acc.unbind(0)  # one op each, whatever R
        for r, p in enumerate(policies):
            p._pos[:nl], p._acc[:nl] = pos_rows[r * nl:(r + 1) * nl], acc_rows[r * nl:(r + 1) * nl]
        return view.per_request(drop)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return prefill_envelope(seq_len, prompt_len,
                                resolve_budget(self.config.budget, seq_len))


@dataclass
class TOVAPolicy:
    """Token Omission Via Attention (Oren et al. 2024; 004_a0d6af55e6947072.txt §2
    "current attention-based eviction", App. C baseline): whenever a layer holds more than C tokens, drop those the current step's
    last query attends to least, averaged over all query heads (`head_mean`).

    Agrees with kvpress `TOVAPress`: its score is the last query's attention averaged
    over heads (one set for every kv head, so layer level is exact) and it pins the
    newest token (padded with max + 1); we protect the newest token the same way. At the
    end of a prompt the last prompt query ranks the whole prompt (kvpress's prefill
    compression, budget = int(n·(1-r))); in decode one token goes per step."""

    config: TOVAConfig
    name: str = "tova"
    needs: Needs = field(default_factory=lambda: Needs(attention=True))

    def step(self, view: StepView) -> Eviction:
        if not is_active(view):
            return {}
        budget = resolve_budget(self.config.budget, view.seq_len)
        att = view.stacked("attention")
        if att is not None and view.lengths[0] > budget:  # same n everywhere: one selection
            pos = view.stacked("positions")
            assert pos is not None
            scores = head_mean(att[:, -1:])[:, 0]
            return dict(enumerate(evict_except_rows(scores, pos, budget, 1).unbind(0)))
        plan: Eviction = {}
        for layer, lv in enumerate(view.layers):
            n = lv.positions.numel()
            if n <= budget:
                continue
            assert lv.attention is not None
            scores = head_mean(lv.attention[-1:])[0]
            plan[layer] = evict_except(scores, lv.positions, budget, edge_mask(n, 0, 1))
        return plan

    @staticmethod
    def step_batch(policies: list[TOVAPolicy], view: BatchView) -> list[torch.Tensor] | None:
        """`step` for R requests at once: the same score and selection per row."""
        budget = view.budget(policies[0].config.budget)
        if budget is None or view.attention is None:
            return None
        if view.positions.shape[1] <= budget:
            return view.per_request(view.positions.new_empty((view.positions.shape[0], 0)))
        return view.per_request(drop_index_rows(head_mean(view.attention[:, None])[:, 0], budget, 1))

    def idle(self, view: StepView) -> bool:
        """TOVA keeps no state: nothing to do before the prompt is complete or while
        every layer is within the budget (H2O has no `idle`: it accumulates every step)."""
        budget = resolve_budget(self.config.budget, view.seq_len)
        return not is_active(view) or all(n <= budget for n in view.lengths)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return prefill_envelope(seq_len, prompt_len,
                                resolve_budget(self.config.budget, seq_len))
