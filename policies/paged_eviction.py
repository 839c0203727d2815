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

from policies.base import Needs, StepView, chunked_envelope, prompt_budget, resolve_budget
from policies.config import Budget, ContextDefault, EvictingPolicyConfig, budget_field
from policies.rows import NATIVE, RowsView, drop_lowest


class PagedEvictionConfig(EvictingPolicyConfig):
    """`budget` C (tokens or ratio of the sequence; the paper sweeps 256-4096, 1024 is its
    headline setting). `compact` defaults to True: Alg. 2 line 13 pages the kept prompt
    tokens *after* the prefill eviction, which in this engine is compaction."""

    name: Literal["paged_eviction"] = "paged_eviction"
    budget: Budget = budget_field(1024)
    compact: bool = Field(True, description=(
        "Pack the kept prompt tokens into whole blocks after the prefill plan (Alg. 2 "
        "line 13), so decode drops whole blocks."))
    window: int = Field(0, ge=0, description=(
        "Most recent tokens never evicted (part of the budget; 0 = the paper). In decode "
        "only blocks wholly older than the window are candidates."))

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"budget": ContextDefault(0.25)}


def token_scores(value_norm: torch.Tensor, key_norm: torch.Tensor) -> torch.Tensor:
    """Alg. 1 token mode: ‖V_i‖/‖K_i‖ per kv head ([..., n, Hkv]) -> mean over heads
    ([..., n])."""
    return (value_norm / key_norm.clamp_min(1e-12)).mean(dim=-1)


def _block_drops(scores: torch.Tensor, live: torch.Tensor, lengths: list[int], bs: int,
                 drop: list[int], windows: list[int] | None = None) -> torch.Tensor:
    """[N, W] mask of the drop[i] full logical blocks with the lowest mean score in row
    i (Alg. 1 block mode), ties toward the earlier block; with `windows`, only blocks
    wholly older than the row's last windows[i] live tokens. Logical block j of a row is
    its live slots of kept-order rank j·bs .. j·bs + bs - 1 (counted from the first live
    token, whatever holes lie between them): the live slots are packed first, in order,
    so that [N, W/bs, bs] holds the blocks. Rows already packed (the engine compacts
    after the prompt's plan and a block drop keeps it so) need no packing: the sort is
    most of this function's cost."""
    n_rows, w = live.shape
    nb = -(-w // bs)  # W is a multiple of bs in the engine; padded when it is not
    ar = torch.arange(w)
    if bool((live == (ar < torch.tensor(lengths)[:, None])).all()):  # packed rows
        packed, rank = scores, ar.expand(n_rows, w)
    else:
        order = torch.where(live, ar, w + ar).argsort(dim=1)  # live slots first, in order
        packed = scores.gather(1, order)
        rank = (live.cumsum(dim=1) - 1).clamp(min=0)
    if nb * bs != w:
        packed = torch.nn.functional.pad(packed, (0, nb * bs - w))
    means = packed.view(n_rows, nb, bs).mean(dim=2)  # [N, nb]: block j's mean if full
    protect = windows or [0] * len(lengths)
    full = torch.arange(nb) < torch.tensor(
        [max(0, n - win) // bs for n, win in zip(lengths, protect)])[:, None]
    # drop_lowest breaks ties toward the later candidate: flipped, toward the earlier
    # block; the full blocks are its candidates (a "position" >= 0)
    gone = drop_lowest(torch.where(full, 0, -1).flip(1), means.flip(1), drop).flip(1)
    return live & gone.gather(1, (rank // bs).clamp(max=nb - 1))


def _record_scores(view: RowsView) -> None:
    """S_i into the view's "score" state: every live token's on the first plan, this
    step's new tokens' from then on (a stored token's norms never change)."""
    scores = view.layered("score")  # [L, R, W]
    if view.key_norm is not None and view.value_norm is not None:
        scores.copy_(token_scores(view.value_norm, view.key_norm).view(scores.shape))
        return
    k, v = view.new_key_norm, view.new_value_norm
    assert k is not None and v is not None
    view.set_new_norm_score("score", k, v, lambda: token_scores(v, k))


def _block_drops_of(scores: torch.Tensor, view: RowsView, blocks: list[int],
                    windows: list[int] | None) -> torch.Tensor:
    """`_block_drops` for the rows that drop a block, the others dropping nothing: a
    request's newest block fills on its own step, so a step's group usually has few
    (rows are independent; the packed-rows shortcut only skips a sort)."""
    rows = [i for i, b in enumerate(blocks) if b]
    if NATIVE["select"] and scores.device.type == "cpu":
        return _block_drops_native(scores, view, rows, blocks, windows)
    scores = scores.reshape(view.shape)  # [L, R, W] state -> [N, W]
    if len(rows) == len(blocks):
        return _block_drops(scores, view.live, view.lengths, view.block_size, blocks, windows)
    at = torch.tensor(rows)
    sub = _block_drops(scores[at], view.positions_of(at) >= 0, [view.lengths[i] for i in rows],
                       view.block_size, [blocks[i] for i in rows],
                       None if windows is None else [windows[i] for i in rows])
    return view.rows_mask(at, sub)


def _block_drops_native(scores: torch.Tensor, view: RowsView, rows: list[int],
                        blocks: list[int], windows: list[int] | None) -> torch.Tensor:
    """`_block_drops_of` in two C++ passes (policies/csrc/select_cpu.cpp: the deciding
    rows' live scores packed, then the blocks' selection and mask) around torch's block
    means, so the same drops bit for bit; `scores` may be the [L, R, W] state in place."""
    bs = view.block_size
    at = torch.tensor(rows, dtype=torch.int64)
    packed = torch.ops.kvserve_policies.pack_live(scores, view.slot_pos, at, bs)
    means = packed.view(len(rows), -1, bs).mean(dim=2)  # [M, nb]: block j's mean if full
    protect = windows or [0] * len(blocks)
    counts = torch.tensor([[max(0, view.lengths[i] - protect[i]) // bs for i in rows],
                           [blocks[i] for i in rows]], dtype=torch.int64)
    return torch.ops.kvserve_policies.block_drops(means, view.slot_pos, at, counts[0],
                                                  counts[1], bs)


_NEW_NORMS = Needs(new_key_norm=True, new_value_norm=True)  # after the first plan


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

    S_i of a stored token never changes, so (as knorm does) the first plan reads every
    live token's norms (`Needs.key_norm`, `value_norm`) and keeps S_i as per-slot state
    (`state`: "score"); from then on each step reads only its new tokens' norms
    (`Needs.new_key_norm`, `new_value_norm`), and a block drop reads no key or value.

    How it runs (`select`, every request of a group at once): the budget and the mode
    (a prompt chunk or decode) are per request, so per row a number of tokens or of
    blocks to drop, from host ints; the token drops are one `drop_lowest` over all rows'
    S_i, the block drops one over all rows' logical-block means (`_block_drops`, which
    groups each row's live slots by kept-order rank, so holes between them do not
    matter).

    Bound: after every prompt chunk's plan n <= C; n only grows by one per decode step and a drop
    happens at the first multiple of block_size above C, so n <= C + block_size - 1
    (C non-decreasing for ratio budgets). kvpress has no PagedEviction press; its
    per-token ratio is not in kvpress either (nothing to compare)."""

    config: PagedEvictionConfig
    name: str = "paged_eviction"
    needs: Needs = field(default_factory=lambda: Needs(key_norm=True, value_norm=True))
    state: ClassVar[dict[str, float]] = {"score": float("nan")}
    # Written where the tables keep it (RowsView.in_place): a decode step sets one
    # value per row and most steps drop nothing, so nothing is copied out or back.
    state_in_place: ClassVar[tuple[str, ...]] = ("score",)
    block_size: int | None = None  # the pool's, learnt from the first view

    @staticmethod
    def select(policies: list[PagedEvictionPolicy], view: RowsView) -> torch.Tensor | None:
        """Prompt-chunk rows drop their lowest-S_i tokens down to C (Alg. 2), decoding
        rows whose newest logical block filled drop whole blocks (Alg. 3): per-row drop
        counts from host ints, then one selection per mode for all rows."""
        c = policies[0].config
        bs = view.block_size
        for p in policies:
            p.block_size = bs
        # C resolved on the whole prompt while it is computed (`prompt_budget`)
        budgets = [resolve_budget(c.budget, max(s, p))
                   for s, p in zip(view.seq_len, view.prompt_len)]
        decodes = [not done and s > p
                   for s, p, done in zip(view.seq_len, view.prompt_len, view.prefill_done)]
        tokens, blocks = [], []  # per row: tokens (prompt) / blocks (decode) to drop
        windows = []  # per row: the recent tokens kept; in decode at most C - bs, so a
        # row above C always has a block older than its window
        for n, budget, decoding in zip(view.lengths, view.per_row(budgets),
                                       view.per_row(decodes)):
            windows.append(min(c.window, max(0, budget - bs) if decoding else budget))
            over = max(0, n - budget)
            tokens.append(0 if decoding else over)
            # one block per block boundary this step's tokens crossed, while n > C
            crossed = n // bs - (n - view.num_new) // bs
            blocks.append(min(crossed, -(-over // bs)) if decoding and crossed > 0 else 0)
        _record_scores(view)
        for p in policies:
            p.needs = _NEW_NORMS
        if not any(tokens) and not any(blocks):
            return None
        scores = view.layered("score")  # [L, R, W]: read in place by the C++ selections
        last = windows if c.window else 0
        drop = drop_lowest(view.live_or_positions, scores, tokens, last=last) if any(tokens) else None
        if any(blocks):
            whole = _block_drops_of(scores, view, blocks, windows if c.window else None)
            drop = whole if drop is None else drop | whole
        return drop

    def idle(self, view: StepView) -> bool:
        """Before the first plan, while every layer is within the budget (that plan
        scores every live token); after it never: every new token's S_i is recorded
        when it is computed (its norms never change), even on the steps that drop
        nothing (Alg. 3 acts only on "L % B == 0", i.e. most decode steps)."""
        self.block_size = view.block_size
        if not self.needs.key_norm:
            return False
        budget = prompt_budget(self.config.budget, view)
        return all(n <= budget for n in view.lengths)

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        bs = block_size or self.block_size
        if bs is None:  # unknown block size: no useful bound
            return seq_len
        return chunked_envelope(self.config.budget, seq_len, prompt_len, bs - 1)
