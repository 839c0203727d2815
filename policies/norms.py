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

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from policies.base import (
    Needs,
    StepView,
    chunked_envelope,
    prompt_budget,
)
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field
from policies.rows import RowsView, keep_highest

_WINDOW_HELP = "Most recent tokens never evicted (part of the budget)."


class KnormConfig(EvictingPolicyConfig):
    ADAPTIVE: ClassVar[bool] = True
    name: Literal["knorm"] = "knorm"
    budget: Budget = budget_field(1024)  # 001's headline budget at 4096
    window: int = Field(0, ge=0, description=_WINDOW_HELP)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


class KeyDiffConfig(EvictingPolicyConfig):
    ADAPTIVE: ClassVar[bool] = True
    name: Literal["keydiff"] = "keydiff"
    budget: Budget = budget_field(1024)
    window: int = Field(0, ge=0, description=_WINDOW_HELP)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


def knorm_scores(key_norm: torch.Tensor) -> torch.Tensor:
    """kvpress `KnormPress.score` = -‖k‖₂ per head ([..., n, Hkv]); mean over kv heads."""
    return -key_norm.mean(dim=-1)


def keydiff_scores(keys: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    """kvpress `KeyDiffPress.score`: anchor = mean over tokens of the L2-normalised keys
    (per head); score = -cos(k_i, anchor), so keys most aligned with the mean direction
    (the most redundant) score lowest. keys [..., n, Hkv, D] -> [..., n], mean over kv
    heads (leading dims: layers or (request, layer) rows scored at once).

    The cosine reuses the normalised keys the anchor needs — a dot with the normalised
    anchor, as `F.cosine_similarity` computes it (norms clamped at its eps 1e-8) — in
    one batched matmul instead of cosine_similarity's broadcast passes (2x faster;
    within 2e-7 of it). `live` ([..., n] bool): only those tokens make the anchor (a
    row of slots with dead ones among them).

    The engine's policy path takes these scores from the decode kernel, which computes
    them per sequence right after its attention read the keys, or else from the pool
    (`Needs.key_diversity`, attention/key_stats.py: the same maths over the keys in place,
    ~15x cheaper than a copy of every key); this is their reference
    (tests/test_key_stats.py) and the fallback (a quantized pool, no compiler, another
    device)."""
    unit = F.normalize(keys, p=2, dim=-1)
    if live is None:
        anchor = unit.mean(dim=-3)  # [..., Hkv, D]
    else:
        w = live.to(unit.dtype)[..., None, None]
        anchor = (unit * w).sum(dim=-3) / w.sum(dim=-3).clamp_min(1)
    anchor = anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(1e-8)
    return -torch.einsum("...nhd,...hd->...nh", unit, anchor).mean(dim=-1)


def _select(view: RowsView, keep: list[int], window: int,
            scores: torch.Tensor) -> torch.Tensor | None:
    """Drop the lowest `scores` down to keep[i] per row, the recent window protected."""
    if view.within(keep):
        return None
    windows = [k if k < window else window for k in keep]
    return keep_highest(view, scores, keep, last=windows)


_NEW_NORMS = Needs(new_key_norm=True)  # what knorm reads after its first plan


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
    state: ClassVar[dict[str, float]] = {"score": float("nan")}
    # Written where the tables keep it (RowsView.in_place): a decode step sets one value
    # per row, so it is not copied out and back.
    state_in_place: ClassVar[tuple[str, ...]] = ("score",)

    @staticmethod
    def select(policies: list[KnormPolicy], view: RowsView) -> torch.Tensor | None:
        """Members share their mode (the group key holds `needs`): all score every
        token (their first plan), or all record the new tokens' scores."""
        c = policies[0].config
        if view.key_norm is not None:
            score = view.layered("score")
            score.copy_(knorm_scores(view.key_norm).view(score.shape))
        else:
            assert view.new_key_norm is not None
            key_norm = view.new_key_norm
            view.set_new_norm_score("score", key_norm, None, lambda: knorm_scores(key_norm))
        for p in policies:
            p.needs = _NEW_NORMS
        keep = view.budgets(c.budget, from_prompt=True)
        if view.within(keep):
            return None
        score = view.layered("score")  # [L, R, W]: the selection reads it in place
        return _select(view, keep, c.window, score)

    def idle(self, view: StepView) -> bool:
        """Before the first plan while every layer is within the budget (that plan
        scores every live token); after it never, since every new token's score must
        be recorded when it is computed (a ratio budget may grow past n)."""
        if not self.needs.key_norm:  # after the first plan: asked every step, so first
            return False
        budget = prompt_budget(self.config.budget, view)
        return all(n <= budget for n in view.lengths)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return chunked_envelope(self.config.budget, seq_len, prompt_len)


@dataclass
class KeyDiffPolicy:
    """KeyDiff (001_01037b507c6df960.txt §5.2 baseline, App. A.2; Park et al. 2025): keep
    diverse keys, evicting those
    most similar (cosine) to the mean key direction of the layer's live tokens,
    recomputed each step over the keys as stored (rotated).

    Agrees with kvpress `KeyDiffPress` (non-block form) at layer level as knorm does: a
    prompt that fits in one prefill chunk is scored at once, as 001's baseline scores
    it. A longer prompt is bounded the way KeyDiff's paper evicts during prefill,
    block-wise (kvpress: `BlockPress`): after every chunk the row goes back to the C the
    prompt's end will have (`prompt_budget`), the anchor taken over what the row holds
    then. Unlike knorm's, the kept set then differs from one whole-prompt plan (the
    anchor moves as keys arrive). Bound: min(seq_len, C) from the first prompt token
    (`chunked_envelope`)."""

    config: KeyDiffConfig
    name: str = "keydiff"
    needs: Needs = field(default_factory=lambda: Needs(key_diversity=True))

    @staticmethod
    def select(policies: list[KeyDiffPolicy], view: RowsView) -> torch.Tensor | None:
        """The scores are the engine's (`Needs.key_diversity`: `keydiff_scores`' maths,
        computed by the decode kernel beside attention, or by the pool over its keys in
        place, attention/key_stats.py), since the anchor moves every step and a copy of
        every live key into the view cost most of a decode step (issue 18)."""
        c = policies[0].config
        keep = view.budgets(c.budget, from_prompt=True)
        if view.within(keep):
            return None
        assert view.key_diversity is not None
        return _select(view, keep, c.window, view.key_diversity)

    def idle(self, view: StepView) -> bool:
        """Nothing to plan: every layer within the budget (KeyDiff keeps no state)."""
        budget = prompt_budget(self.config.budget, view)
        return all(n <= budget for n in view.lengths)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return chunked_envelope(self.config.budget, seq_len, prompt_len)
