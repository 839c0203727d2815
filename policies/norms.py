"""Attention-free, unstructured baselines of 001_01037b507c6df960.txt (§5.2, App. A.2):
inverse key L2-norm (`knorm`, Devoto et al. 2024) and KeyDiff (`keydiff`, Park et al.
2025).

Both score tokens from the cached keys alone and evict token by token: on the step that
completes the prompt the lowest-scoring tokens go down to the budget C (resolved on the
sequence length), then every decode step drops the lowest-scoring token(s) to stay at C
(App. A.2: "the lowest-scoring token is removed in every step"). An optional `window` of
most recent tokens is never evicted (0 by default, as in the paper's baselines and in
kvpress). Scores are computed per kv head exactly as kvpress does and averaged over the
kv heads, because this engine keeps one kept set per layer (kvpress keeps a set per
head): with one kv head the kept set is kvpress's exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from policies.base import (
    BatchView,
    Eviction,
    Needs,
    StepView,
    align,
    align_rows,
    chunked_envelope,
    drop_index_rows,
    edge_mask,
    evict_except,
    evict_except_index,
    evict_except_rows,
    is_active,
    keep_rows,
    prefill_envelope,
    prompt_budget,
    resolve_budget,
    without_rows,
)
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field

_WINDOW_HELP = "Most recent tokens never evicted (part of the budget)."


class KnormConfig(EvictingPolicyConfig):
    name: Literal["knorm"] = "knorm"
    budget: Budget = budget_field(1024)  # 001's headline budget at 4096
    window: int = Field(0, ge=0, description=_WINDOW_HELP)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


class KeyDiffConfig(EvictingPolicyConfig):
    name: Literal["keydiff"] = "keydiff"
    budget: Budget = budget_field(1024)
    window: int = Field(0, ge=0, description=_WINDOW_HELP)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


def knorm_scores(key_norm: torch.Tensor) -> torch.Tensor:
    """kvpress `KnormPress.score` = -‖k‖₂ per head ([..., n, Hkv]); mean over kv heads."""
    return -key_norm.mean(dim=-1)


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """kvpress `KeyDiffPress.score`: anchor = mean over tokens of the L2-normalised keys
    (per head); score = -cos(k_i, anchor), so keys most aligned with the mean direction
    (the most redundant) score lowest. keys [..., n, Hkv, D] -> [..., n], mean over kv
    heads (leading dims: layers or (request, layer) rows scored at once).

    The cosine reuses the normalised keys the anchor needs — a dot with the normalised
    anchor, as `F.cosine_similarity` computes it (norms clamped at its eps 1e-8) — in
    one batched matmul instead of cosine_similarity's broadcast passes (2x faster;
    within 2e-7 of it)."""
    unit = F.normalize(keys, p=2, dim=-1)
    anchor = unit.mean(dim=-3)  # [..., Hkv, D]
    anchor = anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(1e-8)
    return -torch.einsum("...nhd,...hd->...nh", unit, anchor).mean(dim=-1)


def _idle(view: StepView, budget_cfg: int | float) -> bool:
    """`_unstructured` plans nothing: prompt incomplete or every layer within budget."""
    budget = resolve_budget(budget_cfg, view.seq_len)
    return not is_active(view) or all(n <= budget for n in view.lengths)


def _unstructured(view: StepView, budget_cfg: int | float, window: int, stat: str,
                  score: Callable[[torch.Tensor], torch.Tensor]) -> Eviction:
    """Per layer, drop the lowest `score(LayerView.<stat>)` down to the budget, the recent
    `window` protected; one selection for all layers when they hold the same count (decode,
    after the prompt's plan: every layer holds C + 1)."""
    if not is_active(view):
        return {}
    budget = resolve_budget(budget_cfg, view.seq_len)
    stats = view.stacked(stat)
    n = view.lengths[0] if view.lengths else 0
    if stats is not None and n > budget:  # every layer holds n: score and select at once
        pos = view.stacked("positions")
        assert pos is not None
        drop = evict_except_rows(score(stats), pos, budget, min(window, budget))
        return dict(enumerate(drop.unbind(0)))
    plan: Eviction = {}
    for layer, lv in enumerate(view.layers):
        n = lv.positions.numel()
        if n <= budget:
            continue
        protected = edge_mask(n, 0, min(window, budget))
        plan[layer] = evict_except(score(getattr(lv, stat)), lv.positions, budget, protected)
    return plan


def _unstructured_batch(policies: list, view: BatchView, stat: str,
                        score: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor] | None:
    """`_unstructured` for R requests at once (equal configs): the same score and
    selection on every (request, layer) row."""
    c = policies[0].config
    budget, stats = view.budget(c.budget), getattr(view, stat)
    if budget is None or stats is None:
        return None
    if view.positions.shape[1] <= budget:
        return view.per_request(view.positions.new_empty((view.positions.shape[0], 0)))
    return view.per_request(drop_index_rows(score(stats), budget, min(c.window, budget)))


@dataclass
class KnormPolicy:
    """Inverse key L2-norm (001_01037b507c6df960.txt §4.1, §5.2 baseline, App. A.2; Devoto
    et al. 2024): keep the tokens with the lowest ‖K‖₂ — key norm is inversely related to
    the attention a token draws (§4.1) — plus the recent `window`.

    Agrees with kvpress `KnormPress` (score -‖k‖, keep the top int(n·(1-r))) on the same
    keys at layer level when budget = int(n·(1-r)) and window = 0; with several kv heads
    ours ranks by the head-mean of kvpress's score. Bound: min(seq_len, C) once the prompt
    is complete (nothing is evicted before).

    A stored key never changes, so neither does its score: the first plan scores every
    live token (`Needs.key_norm`), and from then on the policy keeps each layer's kept
    positions and scores and asks only for the norms of each step's new tokens
    (`Needs.new_key_norm`), which makes a decode step O(new tokens) instead of a gather
    of every live key. The kept sets are the same (tests/test_policies_norms.py).

    Bounded prefill: it evicts after every prompt chunk too, down to the C the prompt's
    end will have (`prompt_budget`), so its memory is bounded from the first prompt token
    (`chunked_envelope`; the scheduler then prefills in chunks of about C). The kept set
    at the end of the prompt is the one a single whole-prompt plan keeps: a score never
    changes, and a token outside the top C - window of the older tokens seen so far is
    outside it for any superset; the recent window of an earlier chunk only holds tokens
    older than the final window (tests/test_policies_norms.py checks it)."""

    config: KnormConfig
    name: str = "knorm"
    needs: Needs = field(default_factory=lambda: Needs(key_norm=True))
    _pos: list[torch.Tensor] = field(default_factory=list, repr=False)  # per layer, kept
    _score: list[torch.Tensor] = field(default_factory=list, repr=False)

    def step(self, view: StepView) -> Eviction:
        pos, scores = self._scored(view)
        budget = prompt_budget(self.config.budget, view)
        window = min(self.config.window, budget)
        plan: Eviction = {}
        if len({p.numel() for p in pos}) == 1:  # every layer holds n: select at once
            p, s = torch.stack(pos), torch.stack(scores)
            if p.shape[1] > budget:
                drop = drop_index_rows(s, budget, window)
                plan = dict(enumerate(p.gather(1, drop).unbind(0)))
                p, s = without_rows(drop, p, s)
            pos, scores = list(p.unbind(0)), list(s.unbind(0))
        else:
            for layer, (p, s) in enumerate(zip(pos, scores)):
                if p.numel() > budget:
                    drop = evict_except_index(s, budget, 0, window)
                    plan[layer] = p[drop]
                    p, s = without_rows(drop[None], p[None], s[None])
                    pos[layer], scores[layer] = p[0], s[0]
        self._pos, self._score = pos, scores
        self.needs = Needs(new_key_norm=True)
        return plan

    def _scored(self, view: StepView) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's live positions and their scores: from the view's norms when it
        has every token's, else the kept scores followed by this step's new ones (the
        newest positions)."""
        pos = [lv.positions for lv in view.layers]
        if view.layers[0].key_norm is not None:
            return pos, [knorm_scores(lv.key_norm) for lv in view.layers]
        scores = []
        for layer, lv in enumerate(view.layers):
            assert lv.new_key_norm is not None
            s = align(self._pos[layer], self._score[layer], lv.positions, float("nan"))
            k = lv.new_key_norm.shape[0]
            s[s.numel() - k:] = knorm_scores(lv.new_key_norm)
            scores.append(s)
        return pos, scores

    @staticmethod
    def step_batch(policies: list[KnormPolicy], view: BatchView) -> list[torch.Tensor] | None:
        """`step` for R requests at once; members share their mode (batch_key groups by
        `needs`): all score every token (their first plan, when the prompt was within
        the budget), or all extend their kept scores by the new token's."""
        c, nl = policies[0].config, view.num_layers
        budget = view.budget(c.budget)
        if budget is None:
            return None
        if view.new_key_norm is None:
            if view.key_norm is None:
                return None
            scores = knorm_scores(view.key_norm)
        else:
            old = [x for p in policies for x in p._pos[:nl]]
            if len({x.numel() for x in old}) != 1:
                return None
            scores = align_rows(torch.stack(old), torch.stack([x for p in policies for x in p._score]),
                                view.positions, float("nan"))
            scores[:, -1] = knorm_scores(view.new_key_norm[:, 0])
        drop, (pos, scores) = keep_rows(scores, budget, min(c.window, budget),
                                        view.positions, scores)
        pos_rows, score_rows = pos.unbind(0), scores.unbind(0)  # one op each, whatever R
        for r, p in enumerate(policies):
            p._pos = list(pos_rows[r * nl:(r + 1) * nl])
            p._score = list(score_rows[r * nl:(r + 1) * nl])
            p.needs = Needs(new_key_norm=True)
        return view.per_request(drop)

    def idle(self, view: StepView) -> bool:
        """Before the first plan while every layer is within the budget; after it never,
        since every new token's norm must be recorded when it is computed (a ratio
        budget may grow past n)."""
        budget = prompt_budget(self.config.budget, view)
        return not self._pos and all(n <= budget for n in view.lengths)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return chunked_envelope(self.config.budget, seq_len, prompt_len)


@dataclass
class KeyDiffPolicy:
    """KeyDiff (001_01037b507c6df960.txt §5.2 baseline, App. A.2; Park et al. 2025): keep
    diverse keys, evicting those
    most similar (cosine) to the mean key direction of the layer's live tokens,
    recomputed each step over the keys as stored (rotated).

    Agrees with kvpress `KeyDiffPress` (non-block form) at layer level as knorm does.
    KeyDiff's paper evicts block-wise during prefill (kvpress: `BlockPress`); like 001's
    baseline we score the whole prompt at once. Bound: min(seq_len, C)."""

    config: KeyDiffConfig
    name: str = "keydiff"
    needs: Needs = field(default_factory=lambda: Needs(keys=True))

    def step(self, view: StepView) -> Eviction:
        return _unstructured(view, self.config.budget, self.config.window, "keys", keydiff_scores)

    @staticmethod
    def step_batch(policies: list[KeyDiffPolicy], view: BatchView) -> list[torch.Tensor] | None:
        return _unstructured_batch(policies, view, "keys", keydiff_scores)

    def idle(self, view: StepView) -> bool:
        return _idle(view, self.config.budget)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return prefill_envelope(seq_len, prompt_len,
                                resolve_budget(self.config.budget, seq_len))
