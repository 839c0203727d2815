"""SnapKV (Li et al. 2024; 002_f8cea1b3e0b25e86.txt §3.2 eqs. 3-4): compress the prompt
once, by the attention of its last `obs_window` queries.

Also home of the observation-window machinery `pyramid` (KV-X) reuses: `pool_scores`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field

from policies.base import (
    Eviction,
    Needs,
    StepView,
    align,
    edge_mask,
    evict_except,
    is_active,
    prefill_envelope,
    resolve_budget,
)
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field

Pooling = Literal["avg", "max"]


def odd_kernel(value: int) -> int:
    if value % 2 == 0:
        raise ValueError("kernel_size must be odd (SnapKV pads kernel_size // 2 on each side)")
    return value


OddKernel = Annotated[int, Field(ge=1), AfterValidator(odd_kernel)]


class SnapKVConfig(EvictingPolicyConfig):
    """Defaults from SnapKV's code (`init_snapkv`): window 32, max_capacity_prompt 2048,
    kernel 5, avgpool (the paper's ablations also use kernel 7 with maxpool)."""

    name: Literal["snapkv"] = "snapkv"
    budget: Budget = budget_field(2048, "Prompt tokens kept per layer, the observation "
                                  "window included (max_capacity_prompt)")
    obs_window: int = Field(32, ge=1, description=(
        "The last prompt queries whose attention scores the prompt."))
    kernel_size: OddKernel = Field(5, description=(
        "Pooling width over neighbouring positions' scores (odd; 1 = no pooling)."))
    pooling: Pooling = Field("avg", description="Pooling kind: 'avg' or 'max'.")
    sink: int = Field(0, ge=0, description="First tokens always kept (SnapKV and kvpress: none).")

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.5)}


def pool_scores(scores: torch.Tensor, kernel: int, pooling: Pooling = "avg") -> torch.Tensor:
    """SnapKV's smoothing over neighbouring positions: stride 1, padding kernel // 2
    (zeros counted for avg, as F.avg_pool1d's default; -inf for max). [..., m] -> [..., m]."""
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    x = scores.reshape(-1, 1, scores.shape[-1])
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    return pool(x, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(scores.shape)


@dataclass
class SnapKVPolicy:
    """SnapKV (002_f8cea1b3e0b25e86.txt §3.2 eqs. 3-4, which KV-X adopts from Li et al.
    2024): the attention of the last `obs_window` prompt queries (the observation
    window), summed over those queries (eq. 4) and per kv head, is pooled over
    positions (`pool_scores`) on the prompt tokens before the window; per layer the
    pooled scores are averaged over kv heads and the top C - obs_window of those tokens
    are kept together with the whole window (and the first `sink` tokens if sink > 0).
    C = resolve_budget(budget, prompt_len) counts every kept prompt token, window
    included. Generated tokens are never evicted, so the cache grows again in decode.

    Chunked prefill: the window's rows arrive in the last chunk or two; every chunk's rows
    whose query is among the last obs_window prompt positions are summed by position.
    This is exact because a query gives zero mass to later tokens (causality) and
    nothing is evicted before the prompt is complete. The prompt is compressed once, on
    the step that completes it; after that `needs.attention` turns False.

    Agrees with kvpress `SnapKVPress(window_size=obs_window, kernel_size)` (avg pool) and
    SnapKV's `SnapKVCluster` (avg or max): same region, same padding; kvpress averages the
    window queries and the query heads of a group where we sum (same ranking). Both
    select per kv head (kvpress) or per query head (SnapKV); we rank by the head-mean of
    the same scores, which is exact with one kv head. With sink > 0 the first tokens are
    pinned (KV-X's lambda mask, 002 §3.3) — a deliberate extension, off by default.
    Equal scores (frequent with max pooling) keep the earlier position; torch.topk in
    kvpress/SnapKV orders ties arbitrarily, so sets may differ among tied tokens only.
    Bound: min(P, C) + (seq_len - P) once the prompt P is complete."""

    config: SnapKVConfig
    name: str = "snapkv"
    needs: Needs = field(default_factory=lambda: Needs(attention=True))
    _pos: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _acc: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _done: bool = False

    def window_scores(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions, [n, Hkv] summed window attention) gathered so far for a layer."""
        if layer not in self._pos:
            return None
        return self._pos[layer], self._acc[layer]

    def step(self, view: StepView) -> Eviction:
        if self._done:
            return {}
        c = self.config
        prompt = view.prompt_len
        q0 = view.seq_len - view.num_new  # position of this step's first query
        lo, hi = max(0, prompt - c.obs_window - q0), prompt - q0
        for layer, lv in enumerate(view.layers):
            assert lv.attention is not None
            acc = align(self._pos.get(layer), self._acc.get(layer), lv.positions)
            if acc.dim() == 1:
                acc = torch.zeros(lv.positions.numel(), lv.attention.shape[1])
            if hi > lo:
                acc += lv.attention[lo:hi].sum(dim=0).T
            self._pos[layer], self._acc[layer] = lv.positions, acc
        if not is_active(view):
            return {}
        self._done = True
        self.needs = Needs()  # nothing more to observe
        budget = resolve_budget(c.budget, prompt)
        plan: Eviction = {}
        for layer, lv in enumerate(view.layers):
            drop = self._select(lv.positions, self._acc[layer], prompt, budget)
            if drop.numel():
                plan[layer] = drop
        self._pos.clear()
        self._acc.clear()
        return plan

    def idle(self, view: StepView) -> bool:
        """After the prompt was compressed SnapKV never acts again (decode tokens are
        never evicted) and observes nothing."""
        return self._done

    def _select(self, positions: torch.Tensor, acc: torch.Tensor, prompt: int,
                budget: int) -> torch.Tensor:
        c = self.config
        m = int((positions < prompt).sum())  # live prompt tokens come first
        pp = positions[:m]
        if m <= budget:
            return pp[:0]
        win = min(c.obs_window, m)
        sink = min(c.sink, budget)
        if sink + win >= budget:  # window and sinks alone fill it: sinks, then most recent
            return pp[sink: m - (budget - sink)]
        body = m - win  # tokens before the window: the scored region (as SnapKV)
        scores = pool_scores(acc[:body].T, c.kernel_size, c.pooling).mean(dim=0)
        return evict_except(scores, pp[:body], budget - win, edge_mask(body, sink, 0))

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        if prompt_len is None:
            return seq_len
        kept = min(prompt_len, resolve_budget(self.config.budget, prompt_len))
        return prefill_envelope(seq_len, prompt_len, kept + max(0, seq_len - prompt_len))
