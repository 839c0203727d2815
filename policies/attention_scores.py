"""Attention-mass policies that act every step: H2O (`h2o`) and TOVA (`tova`).

Both read `RowsView.attention` ([N, Tq, Hkv, W]: this step's queries' probability mass
on each live token, summed over the query heads of each kv group) and keep one set per
layer, i.e. the mass is aggregated over all heads of the layer. Both keep exactly
min(n, C) tokens after every plan, C = `prompt_budget` (resolved on the whole prompt's
length while the prompt is computed, on the sequence length from then on).

Bounded prefill (issue 20): both plan after every prompt chunk too, so a long prompt
holds C plus one chunk from its first token on (`chunked_envelope`; the scheduler then
prefills in chunks of about C, `KVCacheManager.prefill_chunk`). A prompt that fits in
one chunk is scored whole at its end, as before. A longer one is scored chunk by chunk:
a later chunk's queries no longer see what an earlier plan dropped — what H2O and TOVA
do in decode, one token at a time (003's `H2OEviction.update` and TOVA's loop make no
difference between prompt and generated tokens). docs/policies.md measures the cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field

from policies.base import (
    Needs,
    StepView,
    chunked_envelope,
    head_parts,
    prompt_budget,
    sum_dims,
)
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field
from policies.rows import RowsView, keep_highest


class H2OConfig(EvictingPolicyConfig):
    """003 `H2OEviction(budget, recent_window=128)`; budget 1024 as in 003's comparison."""

    ADAPTIVE: ClassVar[bool] = True
    name: Literal["h2o"] = "h2o"
    budget: Budget = budget_field(1024)
    window: int = Field(128, ge=0, description=(
        "Most recent tokens always kept, part of the budget; the rest are the heaviest "
        "hitters by cumulative attention."))

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {
        "budget": ContextDefault(0.25), "window": ContextDefault(1 / 32)}


class TOVAConfig(EvictingPolicyConfig):
    ADAPTIVE: ClassVar[bool] = True
    name: Literal["tova"] = "tova"
    budget: Budget = budget_field(1024)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


@dataclass
class H2OPolicy:
    """Heavy-Hitter Oracle (Zhang et al. 2023) as 003_12df107fdefa535c.txt
    `H2OEviction` ("Eviction Policies"); 004_a0d6af55e6947072.txt §2/App. C baseline.

    Cumulative attention: every step adds its queries' mass on each live token, summed
    over queries and over all heads (003 `update`: `attention_weights.sum(dim=(0, 1, 2))`);
    prefill chunks accumulate too, so at the end of a one-chunk prompt a token's score is
    its column sum over all prompt queries (over the queries that saw it, when earlier
    chunks' plans dropped tokens: bounded prefill, above). The sum is per-slot state (`acc`, kept by the
    engine beside the slot's position): an evicted token's is forgotten with its slot,
    a new token's starts at 0. Keep (003 `get_eviction_mask`): the last min(window, C)
    tokens, plus the top C - window of the older tokens by cumulative score. Deliberate
    difference from kvpress `ObservedAttentionPress` ("related to H2O"): kvpress divides
    each token's summed attention by the number of queries that could see it and
    averages heads per group; H2O and 003 use the raw sum. In decode, where the kernel
    can, it adds each row's mass into `acc` as it writes it (`Needs.accumulate`: issue
    18's statistics accumulated during attention); the view then carries no mass."""

    config: H2OConfig
    name: str = "h2o"
    needs: Needs = field(default_factory=lambda: Needs(attention=True, accumulate="acc"))
    state: ClassVar[dict[str, float]] = {"acc": 0.0}
    # Added to where the tables keep it (RowsView.in_place): no copy out and back.
    state_in_place: ClassVar[tuple[str, ...]] = ("acc",)

    @staticmethod
    def select(policies: list[H2OPolicy], view: RowsView) -> torch.Tensor | None:
        c = policies[0].config
        acc = view.layered("acc")  # [L, R, W]
        if not view.accumulated:  # else the decode kernel added this step's mass
            assert view.attention is not None
            acc += sum_dims(view.attention, (1, 2)).view(acc.shape)  # [N, Tq, Hkv, W] -> [N, W]
        keep = view.budgets(c.budget, from_prompt=True)
        if view.within(keep):
            return None
        # [L, R, W] as it is: the selection reads the tables' slice in place
        return keep_highest(view, acc, keep, last=[min(c.window, k) for k in keep])

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return chunked_envelope(self.config.budget, seq_len, prompt_len)


@dataclass
class TOVAPolicy:
    """Token Omission Via Attention (Oren et al. 2024; 004_a0d6af55e6947072.txt §2
    "current attention-based eviction", App. C baseline): whenever a layer holds more than C tokens, drop those the current step's
    last query attends to least, averaged over all query heads (`head_mean`).

    Agrees with kvpress `TOVAPress`: its score is the last query's attention averaged
    over heads (one set for every kv head, so layer level is exact) and it pins the
    newest token (padded with max + 1); we protect the newest token the same way. At the
    end of a one-chunk prompt the last prompt query ranks the whole prompt (kvpress's
    prefill compression, budget = int(n·(1-r))); a longer prompt is ranked by each
    chunk's last query in turn (bounded prefill, above); in decode one token goes per
    step."""

    config: TOVAConfig
    name: str = "tova"
    needs: Needs = field(default_factory=lambda: Needs(attention=True))

    @staticmethod
    def select(policies: list[TOVAPolicy], view: RowsView) -> torch.Tensor | None:
        """The last query's head-mean mass ranks every row; the newest token stays."""
        assert view.attention is not None
        c = policies[0].config
        keep = view.budgets(c.budget, from_prompt=True)
        if view.within(keep):
            return None
        # head_mean's quotient, divided as the selection reads each row
        per, total = head_parts(view.attention[:, -1:])
        return keep_highest(view, per[:, 0], keep, last=1, divisor=total[:, 0])

    def idle(self, view: StepView) -> bool:
        """TOVA keeps no state: nothing to do while every layer is within the budget
        (H2O has no `idle`: it accumulates every step)."""
        budget = prompt_budget(self.config.budget, view)
        return all(n <= budget for n in view.lengths)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return chunked_envelope(self.config.budget, seq_len, prompt_len)
