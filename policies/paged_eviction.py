"""PagedEviction (001_01037b507c6df960.txt §4, Algorithms 1-3): attention-free,
block-structured eviction for a paged cache.

Token importance S_i = ‖V_i‖₂ / ‖K_i‖₂ (Alg. 1 line 3; §4.1: key norm is inversely
related to attention, value norm carries the information), read from the cache, so it
needs no attention statistics and works with fused attention kernels. Per layer the
score is the mean of that ratio over the kv heads (the paper's cache keeps one block
table for all heads, so a token is kept or dropped for every head at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field

from policies.base import (
    Eviction,
    Needs,
    StepView,
    chunked_envelope,
    keep_top,
    prompt_budget,
)
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field


class PagedEvictionConfig(EvictingPolicyConfig):
    """`budget` C (tokens or ratio of the sequence; the paper sweeps 256-4096, 1024 is its
    headline setting). `compact` defaults to True: Alg. 2 line 13 pages the kept prompt
    tokens *after* the prefill eviction, which in this engine is compaction."""

    name: Literal["paged_eviction"] = "paged_eviction"
    budget: Budget = budget_field(1024)
    compact: bool = Field(True, description=(
        "Pack the kept prompt tokens into whole blocks after the prefill plan (Alg. 2 "
        "line 13), so decode drops whole blocks."))

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


def token_scores(value_norm: torch.Tensor, key_norm: torch.Tensor) -> torch.Tensor:
    """Alg. 1 token mode: ‖V_i‖/‖K_i‖ per kv head ([n, Hkv]) -> mean over heads ([n])."""
    return (value_norm / key_norm.clamp_min(1e-12)).mean(dim=1)


@dataclass
class PagedEvictionPolicy:
    """PagedEviction (001_01037b507c6df960.txt §4.2-4.3, Algorithms 1-3).

    Prefill (Alg. 2): drop the lowest-S_i tokens of each layer down to C (E = L - C
    tokens), C = resolve_budget(budget, prompt_len). Done after every prompt chunk, not
    only the last, so memory is bounded from the first prompt token (the scheduler
    prefills in chunks of about C); S_i of a stored token never changes, so the kept set
    at the prompt's end is the one a single plan over the whole prompt keeps (the top C
    of a union is within the top C of each part).

    Decode (Alg. 3): a layer's live tokens, in kept order, form logical blocks of
    `view.block_size` consecutive tokens counted from the first live token. The newest
    block fills on the step whose new tokens make the live count n cross a multiple of
    the block size (n % block_size == 0 for one decode token: Alg. 3's "L % B == 0" with
    L the cached length). Then, only if n > C, the full block with the lowest mean S_i
    (Alg. 1 block mode) is dropped whole — block_size consecutive kept tokens — so one
    pool block is freed and every other block stays full. Candidates are all full blocks,
    the newest included ("evaluates all existing pages", §4.3).

    The logical blocks are the pool's physical blocks when the layer is packed in kept
    order, i.e. the engine compacts after the prefill plan (`compact`, default on); a
    whole-block drop then needs no further compaction.

    Bound: after every prompt chunk's plan n <= C; n only grows by one per decode step and a drop
    happens at the first multiple of block_size above C, so n <= C + block_size - 1
    (C non-decreasing for ratio budgets). kvpress has no PagedEviction press; its
    per-token ratio is not in kvpress either (nothing to compare)."""

    config: PagedEvictionConfig
    name: str = "paged_eviction"
    needs: Needs = field(default_factory=lambda: Needs(key_norm=True, value_norm=True))
    block_size: int | None = None  # the pool's, learnt from the first view

    def step(self, view: StepView) -> Eviction:
        self.block_size = view.block_size
        budget = prompt_budget(self.config.budget, view)
        decoding = not view.prefill_done and view.seq_len > view.prompt_len
        plan: Eviction = {}
        for layer, lv in enumerate(view.layers):
            n = lv.positions.numel()
            if n <= budget:
                continue
            assert lv.key_norm is not None and lv.value_norm is not None
            scores = token_scores(lv.value_norm, lv.key_norm)
            if not decoding:  # a prompt chunk (Alg. 2), the last one or an earlier one
                plan[layer] = keep_top(scores, lv.positions, budget)
            else:
                drop = self._block_drops(scores, n, view.num_new, view.block_size, budget)
                if drop is not None:
                    plan[layer] = lv.positions[drop]
        return plan

    def idle(self, view: StepView) -> bool:
        """`step` plans nothing: in a prompt chunk when every layer is within the
        budget; in decode when no layer above the budget fills a
        block this step (Alg. 3 acts only on "L % B == 0"), i.e. most decode steps."""
        self.block_size = view.block_size
        budget = prompt_budget(self.config.budget, view)
        if view.prefill_done or view.seq_len <= view.prompt_len:
            return all(n <= budget for n in view.lengths)
        bs = view.block_size
        return all(n <= budget or n // bs - (n - view.num_new) // bs <= 0 or n < bs
                   for n in view.lengths)

    @staticmethod
    def _block_drops(scores: torch.Tensor, n: int, num_new: int, bs: int,
                     budget: int) -> torch.Tensor | None:
        """Indices (kept order) of the blocks to drop: one per block boundary crossed by
        this step's tokens (one for a decode token), lowest mean first, while n > C."""
        crossed = n // bs - (n - num_new) // bs
        full = n // bs
        if crossed <= 0 or full == 0:
            return None
        means = scores[: full * bs].view(full, bs).mean(dim=1)
        order = torch.sort(means, stable=True).indices  # ties: the earlier block
        picked = []
        for j in order.tolist()[:crossed]:
            if n <= budget:
                break
            picked.append(j)
            n -= bs
        if not picked:
            return None
        blocks = torch.tensor(sorted(picked), dtype=torch.int64)
        return (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        bs = block_size or self.block_size
        if bs is None:  # unknown block size: no useful bound
            return seq_len
        return chunked_envelope(self.config.budget, seq_len, prompt_len, bs - 1)
