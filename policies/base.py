"""What a KV eviction policy sees and returns.

A policy is a small object built from one request's validated `kv_policy` config. After
every step that computed tokens for its request the engine hands it a `StepView` — the
live tokens of every layer, identified by their *original positions*, with the
statistics the policy declared it needs — and the policy answers with an `Eviction`:
per layer, the original positions to drop. It never frees memory nor reads the pool:
the engine carries the plan out (marking slots dead, returning empty blocks at once,
optionally compacting or re-rotating keys), so policies are pure functions of
(config, their own state, the view) and testable without a model.

Tokens are identified by position rather than slot because slots move when blocks are
freed or compacted, while a token's position never changes (with `rope: "shift"` the
engine re-numbers positions; policies that allow it only rely on their order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

# An eviction plan: layer -> original positions to drop (int64, any order).
Eviction = dict[int, torch.Tensor]


@dataclass
class Needs:
    """Statistics a policy asks for; the engine computes only these, only for it."""

    attention: bool = False  # attention mass of this step's queries over live tokens
    key_norm: bool = False  # ‖K‖₂ per live token and kv head
    value_norm: bool = False  # ‖V‖₂ per live token and kv head
    keys: bool = False  # the key vectors themselves (as stored: rotated)


@dataclass
class LayerView:
    positions: torch.Tensor  # [n] int64, ascending: live tokens of this layer
    # [Tq, Hkv, n] float32: this step's queries' probability mass per live token, summed
    # over the query heads of each kv group (so it sums to G per query and kv head).
    attention: torch.Tensor | None = None
    key_norm: torch.Tensor | None = None  # [n, Hkv] float32
    value_norm: torch.Tensor | None = None  # [n, Hkv] float32
    keys: torch.Tensor | None = None  # [n, Hkv, D] float32


@dataclass
class StepView:
    seq_len: int  # tokens processed so far (prompt + generated, whose K/V were computed)
    prompt_len: int
    num_new: int  # tokens computed this step (queries of `attention`)
    prefill_done: bool  # this step computed the last prompt token (first time only)
    block_size: int
    layers: list[LayerView] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


class Policy(Protocol):
    name: str
    needs: Needs

    def step(self, view: StepView) -> Eviction:
        """Called after every step that computed tokens of this request."""
        ...


def resolve_budget(budget: int | float, length: int) -> int:
    """A budget is a token count (int >= 1) or a ratio of `length` (float in (0, 1])."""
    if isinstance(budget, float):
        return max(1, round(budget * length))
    return budget


def keep_top(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Positions NOT among the k highest scores (the ones to evict).

    Ties break toward the earlier position (stable), so results are deterministic."""
    n = positions.numel()
    if k >= n:
        return positions[:0]
    order = torch.sort(scores, descending=True, stable=True).indices
    return positions[order[k:]].sort().values
