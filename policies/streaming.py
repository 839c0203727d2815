"""Position-only policies: StreamingLLM (`streaming`) and Lazy Pruning with Slack and
Max_Drop (`lazy_streaming`).

Both keep the first S "attention sink" tokens plus the most recent tokens and need no
statistics. They only use the *order* of the live tokens (first S, last k), never
position values, so they allow `rope: "shift"` (the engine re-numbers positions and
re-rotates keys, 000_8900623ad98b28fb.txt §3.1 eq. 4) and then run past the model's
position limit. Unlike the scoring policies they act after every step, prefill chunks
included: a chunked prefill never holds more than the cap plus one chunk, and the kept
set after the last prompt chunk is the same as for an unchunked prefill (it depends on
order only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field

from policies.base import Needs, StepView
from policies.config import ContextDefault, EvictingPolicyConfig
from policies.rows import RowsView, drop_earliest

Rope = Literal["original", "shift"]
_ROPE_HELP = ("'original' keeps each token's position; 'shift' re-numbers the kept tokens "
              "0..n-1 and re-rotates their keys (000 §3.1), so generation may run past the "
              "model's position limit.")


class StreamingConfig(EvictingPolicyConfig):
    """StreamingLLM: `sink` first tokens + `window` most recent (003 `AttentionSinkEviction`
    defaults: 4 sinks, 1024 recent)."""

    name: Literal["streaming"] = "streaming"
    sink: int = Field(4, ge=0, description="First tokens always kept (attention sinks).")
    window: int = Field(1024, ge=1, description="Most recent tokens kept besides the sinks.")
    rope: Rope = Field("original", description=_ROPE_HELP)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {"window": ContextDefault(0.25)}


class LazyStreamingConfig(EvictingPolicyConfig):
    """000 Algorithm 1 parameters; defaults are the paper's toy example
    (S, W, R, σ, δ) = (4, 2044, 32, 16, 32), B = 0 (§3.1: B = 0 in all experiments)."""

    name: Literal["lazy_streaming"] = "lazy_streaming"
    sink: int = Field(4, ge=0, description="S: first tokens always kept (attention sinks).")
    window: int = Field(2044, ge=1, description="W: most recent tokens of the core capacity S + W.")
    extra: int = Field(0, ge=0, description="B: extra soft capacity beyond S + W (eq. 2).")
    compress_every: int = Field(32, ge=0, description=(
        "R: prune only once the overflow beyond the capacity reaches R tokens; 0 disables "
        "pruning."))
    slack: int = Field(16, ge=0, description="σ: hard cap H = capacity + σ (eq. 7).")
    max_drop: int = Field(32, ge=0, description=(
        "δ: most tokens dropped per prune event (eq. 8); 0 drops down to the capacity."))
    rope: Rope = Field("original", description=_ROPE_HELP)

    CONTEXT_DEFAULTS: ClassVar[dict[str, ContextDefault]] = {
        "window": ContextDefault(0.5, minus="sink")}


def drop_middle(view: RowsView, sink: int, keep: list[int]) -> torch.Tensor | None:
    """Per row: keep the first `sink` and the most recent keep[i] - sink live tokens,
    i.e. drop the live tokens of rank sink + 1 .. sink + (n - keep[i]) (rows within
    keep[i] keep everything); None when no row drops. The counts are host ints."""
    # (a conditional, not max(): this runs for every (request, layer) row every step)
    return drop_earliest(view, [n - k if n > k else 0 for n, k in zip(view.lengths, keep)],
                         sink)


@dataclass
class StreamingPolicy:
    """StreamingLLM (Xiao et al.; 003_12df107fdefa535c.txt `AttentionSinkEviction`;
    001_01037b507c6df960.txt App. A.1; 000_8900623ad98b28fb.txt §3.1 eq. 3).

    Kept set I = {first `sink`} ∪ {last `window`} of the live tokens (000 eq. 3), applied
    after every step, so a layer never holds more than sink + window after a plan (one
    token evicted per decode step, 001 App. A.1). Agrees with kvpress
    `StreamingLLMPress(n_sink=sink)` at compression ratio r on an n-token prefill when
    window = int(n·(1-r)) - sink: it zeroes the scores of tokens [sink, sink + n_pruned)
    and keeps the rest, i.e. the same first-sink + most-recent set (same for every head,
    so layer level is exact)."""

    config: StreamingConfig
    name: str = "streaming"
    needs: Needs = field(default_factory=Needs)

    @staticmethod
    def select(policies: list[StreamingPolicy], view: RowsView) -> torch.Tensor | None:
        c = policies[0].config
        return drop_middle(view, c.sink, [c.sink + c.window] * len(view.lengths))

    @property
    def ring(self) -> tuple[int, int] | None:
        """(sink, sink + window): in decode, once a layer holds sink + window tokens, the
        engine writes each new token over the oldest past the sinks (kvpool/tables.py,
        `SlotTables.start_ring`) instead of evicting it after the step. The kept set
        after every step is the same; the step's attention sees the cache the paper
        keeps, sink + window tokens with the new one (001_01037b507c6df960.txt App. A.1;
        StreamingLLM's own cache makes room before it appends), not one token more; and a
        request at its window holds exactly ceil((sink + window) / block_size) blocks a
        layer. None with `rope: "shift"`, which renumbers the kept tokens by order."""
        c = self.config
        return (c.sink, c.sink + c.window) if c.rope == "original" else None

    def idle(self, view: StepView) -> bool:
        """No layer holds more than sink + window: `step` keeps everything."""
        return max(view.lengths, default=0) <= self.config.sink + self.config.window

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        return min(seq_len, self.config.sink + self.config.window)


def lazy_target(length: int, sink: int, window: int, extra: int, compress_every: int,
                slack: int, max_drop: int) -> int | None:
    """000 Algorithm 1 lines 1-16: the retained length L*_t, or None (no prune).

    C0 = S + W (eq. 1), C = C0 + B (eq. 2), H = C + σ (eq. 7); prune only when R > 0
    and overflow L - C >= R (eqs. 5-6); then L* = C if δ = 0 else
    min(max(L - δ, C), H) (eq. 8)."""
    c = sink + window + extra
    h = c + slack
    if compress_every == 0 or length <= c or length - c < compress_every:
        return None
    return c if max_drop == 0 else min(max(length - max_drop, c), h)


@dataclass
class LazyStreamingPolicy:
    """Lazy Pruning + Slack + Max_Drop on top of StreamingLLM
    (000_8900623ad98b28fb.txt §3.2-3.4, Algorithm 1, eqs. 5-8).

    After every step, per layer with L live tokens: if `lazy_target` gives L*, keep the
    first S and the most recent L* - S tokens (Alg. 1 line 17). Pruning is amortised
    (only once the overflow reaches R) and staged (at most δ dropped per event, never
    above H). Toy example (§3.4): (S, W, R, σ, δ) = (4, 2044, 32, 16, 32), L = 2090 ->
    L* = min(max(2058, 2048), 2064) = 2058.

    Bound after a plan: C + R - 1 tokens without a prune, L* <= H (δ > 0) or C (δ = 0)
    with one, so max_live = min(seq_len, C + max(R - 1, σ if δ > 0 else 0)); unbounded
    (seq_len) when R = 0. kvpress has no lazy/staged variant (nothing to compare)."""

    config: LazyStreamingConfig
    name: str = "lazy_streaming"
    needs: Needs = field(default_factory=Needs)

    @staticmethod
    def select(policies: list[LazyStreamingPolicy], view: RowsView) -> torch.Tensor | None:
        """Each row prunes to its own L* when its overflow reached R."""
        p = policies[0]
        keep = [n if t is None else t for n, t in ((n, p._target(n)) for n in view.lengths)]
        return drop_middle(view, p.config.sink, keep)

    def _target(self, n: int) -> int | None:
        """L* for a layer of n live tokens when it prunes (L* < n), else None."""
        c = self.config
        target = lazy_target(n, c.sink, c.window, c.extra, c.compress_every, c.slack,
                             c.max_drop)
        return target if target is not None and target < n else None

    def idle(self, view: StepView) -> bool:
        """No layer's overflow reached R (Alg. 1 lines 1-16): nothing to prune, which is
        most steps — the point of lazy pruning. A layer prunes only once its overflow
        reaches R, so the longest layer decides for all (this runs for every request on
        every step)."""
        return self._target(max(view.lengths, default=0)) is None

    def max_live(self, seq_len: int, prompt_len: int | None = None,
                 block_size: int | None = None) -> int:
        c = self.config
        if c.compress_every == 0:
            return seq_len
        cap = c.sink + c.window + c.extra
        over = max(c.compress_every - 1, c.slack if c.max_drop > 0 else 0)
        return min(seq_len, cap + over)
