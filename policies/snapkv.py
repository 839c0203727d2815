"""SnapKV (Li et al. 2024; 002_f8cea1b3e0b25e86.txt §3.2 eqs. 3-4): compress the prompt
once, by the attention of its last `obs_window` queries.

Also home of the observation-window machinery `pyramid` (KV-X) reuses: `pool_scores`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field

from policies.base import Needs, StepView, prompt_once_live, resolve_budget
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field
from policies.heads import adaptive_drops
from policies.rows import RowsView, drop_lowest

Pooling = Literal["avg", "max"]


def odd_kernel(value: int) -> int:
    if value % 2 == 0:
        raise ValueError("kernel_size must be odd (SnapKV pads kernel_size // 2 on each side)")
    return value


OddKernel = Annotated[int, Field(ge=1), AfterValidator(odd_kernel)]


class SnapKVConfig(EvictingPolicyConfig):
    """Defaults from SnapKV's code (`init_snapkv`): window 32, max_capacity_prompt 2048,
    kernel 5, avgpool (the paper's ablations also use kernel 7 with maxpool)."""

    ADAPTIVE: ClassVar[bool] = True
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
    whose query is among the last obs_window prompt positions are summed per slot (the
    policy keeps the sum of earlier chunks, [L, Hkv, S], until the prompt is complete:
    no per-slot state, since nothing is evicted before then a slot holds the same token
    from chunk to chunk). This is exact because a query gives zero mass to later tokens
    (causality). The prompt is compressed once, on the step that completes it, for all
    the requests of a batch that complete theirs (`select`); after that
    `needs.attention` turns False and `idle` holds.

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
    needs: Needs = field(default_factory=lambda: Needs(attention=True, attention_heads=True))
    # [L, Hkv, S]: the window rows of earlier prompt chunks, summed, by slot (slot j holds
    # position j: nothing is evicted before the prompt is complete). None until a window
    # row arrived, and again once the prompt was compressed.
    _acc: torch.Tensor | None = field(default=None, repr=False)
    _done: bool = False

    @staticmethod
    def select(policies: list[SnapKVPolicy], view: RowsView) -> torch.Tensor | None:
        """Sum every row's observation-window queries of this step (and of its earlier
        chunks); the rows of the requests whose prompt is complete keep their C prompt
        tokens, the others only accumulate."""
        if all(p._done for p in policies):
            return None
        c = policies[0].config
        att = view.attention
        assert att is not None
        tq = att.shape[1]
        spans = []  # per request: this step's query rows inside the window
        for s, prompt in zip(view.seq_len, view.prompt_len):
            q0 = s - view.num_new  # position of this step's first query
            lo = min(tq, max(0, prompt - c.obs_window - q0))
            spans.append((lo, max(lo, min(tq, prompt - q0))))
        total = None  # [N, Hkv, W]: summed window mass per slot and kv head
        if len(set(spans)) == 1:
            lo, hi = spans[0]
            if hi > lo:
                total = att[:, lo:hi].sum(dim=1)
        elif any(hi > lo for lo, hi in spans):
            lo = view.row_tensor(view.per_row([lo for lo, _ in spans]))
            hi = view.row_tensor(view.per_row([hi for _, hi in spans]))
            rows = torch.arange(tq)
            total = (att * ((rows >= lo) & (rows < hi))[:, :, None, None]).sum(dim=1)
        n, hkv, width = att.shape[0], att.shape[2], att.shape[3]
        seen = [hi > lo or p._acc is not None for p, (lo, hi) in zip(policies, spans)]
        for r, p in enumerate(policies):
            if p._acc is not None:  # earlier chunks' window rows
                if total is None:
                    total = att.new_zeros((n, hkv, width))
                total[view.rows_of(r), :, :p._acc.shape[2]] += p._acc
                p._acc = None
        active = []
        for r, (p, s, prompt, done) in enumerate(zip(policies, view.seq_len, view.prompt_len,
                                                       view.prefill_done)):
            if p._done:
                active.append(False)
            elif done or s > prompt:  # the prompt is complete: compress it now
                p._done = True
                p.needs = Needs()  # nothing more to observe
                active.append(True)
            else:
                if seen[r] and total is not None:
                    live = max(view.lengths[view.rows_of(r)])
                    p._acc = total[view.rows_of(r), :, :live].clone()
                active.append(False)
        if not any(active):
            return None
        if total is None:  # no window row was computed (nothing to rank by)
            total = att.new_zeros((n, hkv, width))
        return _drop(c, view, view.per_row(active), total)

    def idle(self, view: StepView) -> bool:
        """After the prompt was compressed SnapKV never acts again (decode tokens are
        never evicted) and observes nothing."""
        return self._done

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return prompt_once_live(self.config.budget, seq_len, prompt_len)

    def max_live_decoding(self, seq_len: int, prompt_len: int | None = None,
                          block_size: int | None = None) -> int:
        return prompt_once_live(self.config.budget, seq_len, prompt_len, decoding=True)


def _drop(c: SnapKVConfig, view: RowsView, active: list[bool],
          total: torch.Tensor) -> torch.Tensor | None:
    """The drop mask of the `active` rows, each keeping C = resolve_budget(budget,
    prompt_len) of its m live prompt tokens (the first m live slots): if sinks and the
    window alone fill C, the first `sink` and the most recent C - sink; otherwise the
    first `sink`, the window and the top C - obs_window - sink of the tokens before the
    window (the scored region, as SnapKV) by their pooled window mass averaged over kv
    heads. Rows within C, and inactive rows, drop nothing."""
    live, pos = view.live, view.positions
    prompts = view.per_row(view.prompt_len)
    m_rows = (live & (pos < view.row_tensor(prompts))).sum(dim=1).tolist()
    skip = (0, 0)
    a_span, b_body, b_sink, b_drop = [], [], [], []  # per row
    for on, m, prompt in zip(active, m_rows, prompts):
        budget = resolve_budget(c.budget, prompt)
        a, body, sink, drop = skip, 0, 0, 0
        if on and m > budget:
            win = min(c.obs_window, m)
            sink = min(c.sink, budget)
            if sink + win >= budget:  # window and sinks alone fill it: sinks, then recent
                a = (sink, m - budget + sink)
            else:
                body, drop = m - win, m - budget
        a_span.append(a)
        b_body.append(body)
        b_sink.append(sink)
        b_drop.append(drop)
    if all(a == skip for a in a_span) and not any(b_drop):
        return None
    rank = live.cumsum(dim=1)  # 1 on the first live slot
    out = torch.zeros_like(live)
    if any(a != skip for a in a_span):
        lo = view.row_tensor([a[0] for a in a_span])
        hi = view.row_tensor([a[1] for a in a_span])
        out |= live & (rank > lo) & (rank <= hi)
    if any(b_drop):
        body = view.row_tensor(b_body)
        region = live & (rank <= body)  # the tokens before the window, pooled alone
        pad = 0.0 if c.pooling == "avg" else -math.inf  # what pooling pads with
        scores = pool_scores(total.masked_fill(~region[:, None, :], pad), c.kernel_size,
                             c.pooling).mean(dim=1)
        # candidates: live ranks in (sink, body], i.e. all but the first `sink` live
        # slots and the last n - body (the window and anything after it)
        after = [n - b for n, b in zip(view.lengths, b_body)]
        if view.adaptive:  # AdaKV over SnapKV's scores (policies/heads.py)
            keep = [n - d for n, d in zip(view.lengths, b_drop)]
            b_drop = adaptive_drops(scores, live, view.lengths, keep, view.heads,
                                    view.num_requests, b_sink, after)
        out |= drop_lowest(view.positions, scores, b_drop, b_sink, after)
    return out
